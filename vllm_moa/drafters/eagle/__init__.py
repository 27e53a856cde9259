"""EAGLE, a baseline trained in the same framework as MoA (MOA_SPEC "Baselines").

At position i the input is [token_embed(x_{i+1}) | f_i] (f = the target's final, normalised
hidden state), projected by `fc` (2E -> E, no bias) and passed through one causal decoder layer
without input norm (EAGLE-1's layout, the one vLLM's `EagleLlamaForCausalLM` loads: `vllm-moa
export-eagle`); the output predicts f_{i+1}, read by the target's LM head without a final norm.
1-step bounded, TLI = 0.

config.py: EagleConfig; model.py: EagleDrafter; proposer.py: EagleProposer (chains and EAGLE-2
trees); method.py: EagleMethod (training). Registered in vllm_moa.kinds.
"""
