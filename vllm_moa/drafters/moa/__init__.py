"""Mixture of Attentions (docs: MOA_SPEC.md): LSA over every target layer's K|V builds a memory
that CA reads; SA runs over the target's token embeddings; with TLI > 0 the target's last layers
finish the draft.

config.py: MoAConfig; model.py: MoADrafter (with a draft vocabulary, its token ids `draft_ids`:
`train --draft-vocab`); proposer.py: MoAProposer (chains and EAGLE-2 trees); method.py: MoAMethod
(training). Registered in vllm_moa.kinds.
"""
