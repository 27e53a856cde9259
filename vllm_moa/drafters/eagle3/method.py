"""EAGLE-3's training: EAGLE's forward (vllm_moa/drafters/eagle/method.py) on the EAGLE-3
drafter, with no feature loss (EAGLE-3 trains its tokens only) and no feature noise. Its
training-time test is token-aligned training (training/alignment.py) with the kind's defaults
(kinds.py: 7 passes, no top-k mask, pass n weighted 0.8^(n-1)); the drafter passes each pass's
outputs on with their gradient (`Eagle3Drafter.DETACH_FED`). With a reduced draft vocabulary
its forwards carry the drafter's t2d (`DraftForward.vocab`): the loss then trains the target's
distribution restricted to the draft vocabulary, at the positions whose target argmax lies in it
(training/losses.py), as the authors' `cnets.py` does."""

from __future__ import annotations

import dataclasses

import torch

from vllm_moa.drafters.eagle.method import EagleMethod
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.hf_target.adapter import HFTarget
from vllm_moa.training.methods import DraftForward


class Eagle3Method(EagleMethod):
    def __init__(
        self, drafter: Eagle3Drafter, target: HFTarget, feature_noise: float = 0.0
    ) -> None:
        # EAGLE-3 adds no noise to the target's states (the authors' training has none).
        super().__init__(drafter, target, feature_noise=0.0)

    def _feature_pairs(
        self, predicted: torch.Tensor, truth: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """None: EAGLE-3's output is not a target state (no feature loss)."""
        return []

    def _output(self, out: torch.Tensor, truth: torch.Tensor) -> DraftForward:
        forward = super()._output(out, truth)
        assert isinstance(self.drafter, Eagle3Drafter)
        return dataclasses.replace(forward, vocab=self.drafter.t2d)
