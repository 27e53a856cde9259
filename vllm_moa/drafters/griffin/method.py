"""GRIFFIN's training: EAGLE's (vllm_moa/drafters/eagle/method.py), whose forward, unrolled
evaluation and multi-pass token-aligned training go through the drafter's `fuse` and `heads`.
The paper trains it with `--align-steps 3 --align-topk 3`; without them it is the paper's
"TAD without TAT" ablation."""

from __future__ import annotations

from vllm_moa.drafters.eagle.method import EagleMethod
from vllm_moa.drafters.griffin.model import GriffinDrafter
from vllm_moa.hf_target.adapter import HFTarget


class GriffinMethod(EagleMethod):
    def __init__(
        self, drafter: GriffinDrafter, target: HFTarget, feature_noise: float = 0.0
    ) -> None:
        super().__init__(drafter, target, feature_noise)
