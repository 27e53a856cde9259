"""The independent drafter, a baseline trained in the same framework as MoA (MOA_SPEC
"Baselines"): a small causal LM over the target's token embeddings with a final norm, read by the
target's LM head; it never sees target activations.

config.py: IndependentConfig; model.py: IndependentDrafter; proposer.py: IndependentProposer
(chains and EAGLE-2 trees); method.py: IndependentMethod (training). Registered in
vllm_moa.kinds.
"""
