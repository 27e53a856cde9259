"""EAGLE-3 (Li et al., 2025, "Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"), the drafter vLLM and SGLang users deploy today, as a baseline trained in the
same framework as MoA.

The drafter reads three target states per verified position, the inputs of a low, a middle and a
high layer (vLLM's and the authors' default: layers 2, L//2, L-3), concatenated and projected by
`fc` (3E -> E, no bias) into the feature h. One decoder layer reads [norm(token embedding) |
norm(h)] (2E) in its attention, with h itself as the residual; its output, before a final norm,
is fed back as the next draft step's h; after the final norm its own LM head reads it. Trained
with the "training-time test": 7 token-aligned passes, each fed the previous pass's outputs with
their gradient, no feature loss, pass n weighted 0.8^(n-1) (training/alignment.py).

config.py: Eagle3Config; model.py: Eagle3Drafter (an EagleDrafter whose target features, fusion,
layer and LM head differ); proposer.py: Eagle3Proposer (EAGLE's chains and EAGLE-2 trees);
method.py: Eagle3Method; split.py: the client-server split (the three states cross the link).
The reduced draft vocabulary's tokens come from drafters/draft_vocab.py (`train --draft-vocab`,
shared with MoA); d2t / t2d in model.py.
Registered in vllm_moa.kinds; `vllm-moa export-eagle` writes vLLM's `eagle3` format.
docs/eagle3.md has the comparison with the authors' release and vLLM.
"""
