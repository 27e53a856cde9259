"""The registry's factories, one floor above the drafter kinds and checkpoints: a kind's
proposer for a loaded drafter (`proposers.make_proposer`), a hierarchy level
(`proposers.level_proposer`), and a training run's drafter, method and saver
(`methods.make_trainer`). Everything below them (decoding, training) takes what they build."""
