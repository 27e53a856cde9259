"""GRIFFIN drafting: EAGLE's proposer (chains and EAGLE-2 trees) on the GRIFFIN drafter, whose
`fuse` is Token-Guided Fusion and whose `heads` split the layer's output into the state the LM
head reads and the feature the next step reads."""

from __future__ import annotations

from vllm_moa.drafters.eagle.proposer import EagleProposer
from vllm_moa.drafters.griffin.model import GriffinDrafter
from vllm_moa.hf_target.adapter import HFTarget


class GriffinProposer(EagleProposer):
    def __init__(self, drafter: GriffinDrafter, target: HFTarget) -> None:
        super().__init__(drafter, target)
