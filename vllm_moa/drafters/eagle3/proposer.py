"""EAGLE-3 drafting: EAGLE's proposer (chains and EAGLE-2 trees) on the EAGLE-3 drafter, whose
`target_features` project the three target states, whose `fuse` and layer read [embedding |
feature], and whose `logits` are its own LM head's."""

from __future__ import annotations

from vllm_moa.drafters.eagle.proposer import EagleProposer
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.hf_target.adapter import HFTarget


class Eagle3Proposer(EagleProposer):
    def __init__(self, drafter: Eagle3Drafter, target: HFTarget) -> None:
        super().__init__(drafter, target)
