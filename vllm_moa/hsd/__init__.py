"""Hierarchical Speculative Decoding (HSD, docs/hsd.md): stacks of drafters under the target,
each level verifying the one below losslessly. `hierarchy.py` runs a stack (on the standalone
engine's proposers), `plan.py` picks the fastest stack from a latency model and `measure.py`
measures its inputs; the commands (`generate --hierarchy`, `hsd-plan`) are in cli/hsd.py, on the
command line's floor."""
