"""The proposer for a loaded drafter, whatever its kind (the registry names it)."""

from __future__ import annotations

from torch import nn

from vllm_moa.decoding.proposer import Proposer
from vllm_moa.drafters import kind_of
from vllm_moa.hf_target.adapter import HFTarget


def make_proposer(drafter: nn.Module, target: HFTarget) -> Proposer:
    proposer: Proposer = kind_of(drafter).proposer_class()(drafter, target)
    return proposer
