"""GRIFFIN's drafter (arXiv 2502.11018, Section 4.2, "token-alignable draft model"): EAGLE with
Token-Guided Fusion (the input token fused with the feature by `fc`, then used again by an MLP
that refines the fused state) and a Token-Enhanced Head (the layer's MLP writes two states: one
the LM head reads, one the next draft step reads as its feature).

config.py: GriffinConfig; model.py: GriffinDrafter (an EagleDrafter whose fusion, layer and
heads differ); proposer.py: GriffinProposer (EAGLE's chains and EAGLE-2 trees); method.py:
GriffinMethod (EAGLE's training, token-aligned with `--align-steps`). Registered in
vllm_moa.kinds. vLLM's EAGLE loader cannot hold TGF or TEH: `export-eagle` refuses it.
"""
