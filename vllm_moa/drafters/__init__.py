"""The drafter kinds, one folder each (moa/, eagle/, griffin/, independent/): config.py, model.py,
proposer.py, method.py and split.py, registered in vllm_moa/kinds.py; presets.py sizes them for
a target, token_layers.py holds what the baselines share and draft_vocab.py the reduced draft
vocabulary's choice (MoA's and EAGLE-3's)."""
