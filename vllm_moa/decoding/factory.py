"""The proposer for a loaded drafter, whatever its kind."""

from __future__ import annotations

from torch import nn

from vllm_moa.decoding.baseline_proposers import EagleProposer, IndependentProposer
from vllm_moa.decoding.moa_proposer import MoAProposer
from vllm_moa.decoding.proposer import Proposer
from vllm_moa.hf_target.adapter import HFTarget
from vllm_moa.model.baselines import EagleDrafter, IndependentDrafter
from vllm_moa.model.moa import MoADrafter


def make_proposer(drafter: nn.Module, target: HFTarget) -> Proposer:
    if isinstance(drafter, MoADrafter):
        return MoAProposer(drafter, target)
    if isinstance(drafter, EagleDrafter):
        return EagleProposer(drafter, target)
    if isinstance(drafter, IndependentDrafter):
        return IndependentProposer(drafter, target)
    raise TypeError(f"no proposer for a {type(drafter).__name__}")
