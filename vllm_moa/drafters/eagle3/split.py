"""EAGLE-3's client-server split (drafters/split.py): the server reads the target's three
feature states and sends fc's projection of them, the feature h (E values a token, where the
three states are 3E); the client holds the rest of the drafter (the layer, the final norm, its LM
head) and the target's embeddings."""

from __future__ import annotations

import torch
from torch import nn

from vllm_moa.decoding.proposer import Proposer
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.drafters.eagle3.proposer import Eagle3Proposer
from vllm_moa.drafters.split import FinalFeature
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput


class DeviceEagle3Proposer(Eagle3Proposer):
    """EAGLE-3's standalone proposer on the client: the features arrive projected (the
    server's `Eagle3Split.rows`), under the key of the target's final state
    (`FinalFeature.client_output`)."""

    def _features(self, verified: TargetOutput) -> torch.Tensor:
        return verified.hidden_states[self.target.shape.num_layers]


class Eagle3Split(FinalFeature):
    def hidden_layers(self, drafter: nn.Module, num_layers: int) -> tuple[int, ...]:
        assert isinstance(drafter, Eagle3Drafter)
        return drafter.feature_layers()

    @torch.no_grad()
    def rows(
        self, drafter: nn.Module, verified: TargetOutput, positions: torch.Tensor, num_layers: int
    ) -> list[torch.Tensor]:
        assert isinstance(drafter, Eagle3Drafter)
        return [drafter.target_features(verified.hidden_states)]

    def client_proposer(self, drafter: nn.Module, target: HFTarget) -> Proposer | None:
        assert isinstance(drafter, Eagle3Drafter)
        return DeviceEagle3Proposer(drafter, target)
