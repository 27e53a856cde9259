"""The reproducible testbed: a trained small target and drafters trained against it."""
