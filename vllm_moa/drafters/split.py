"""What a drafter kind's client-server split is (vllm_moa/remote/: the drafter on the user's
device, the target on a server): each kind names its `Split` in the registry
(`DrafterKind.split`), and the server and client ask it what to compute and send per verified
token; remote/ never branches on kinds."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from vllm_moa.decoding.proposer import Proposer
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput


class Split(Protocol):
    """One kind's split. The server holds the drafter and the target; the client holds the
    drafter's device half and a proposer over what the server sends."""

    def hidden_layers(self, drafter: nn.Module, num_layers: int) -> tuple[int, ...]:
        """Hidden states the server's target pass must return for `rows`."""
        ...

    def rows(
        self, drafter: nn.Module, verified: TargetOutput, positions: torch.Tensor, num_layers: int
    ) -> list[torch.Tensor]:
        """Per verified token (rows of `verified`, at `positions`), the tensors to send, each
        [n, ..., W] (one int8 scale per W-vector)."""
        ...

    def client_proposer(self, drafter: nn.Module, target: HFTarget) -> Proposer | None:
        """The client's proposer, or None for the kind's standalone proposer."""
        ...

    def client_output(self, num_layers: int, tensors: list[torch.Tensor], n: int) -> TargetOutput:
        """The TargetOutput the client's proposer reads, from the server's rows for n tokens."""
        ...

    def expected_rows(self, tli: int) -> int:
        """How many tensors a STARTED / VERIFIED message carries."""
        ...


class TokensOnly:
    """A drafter that reads nothing of the target (the independent small model): only tokens
    cross the link."""

    def hidden_layers(self, drafter: nn.Module, num_layers: int) -> tuple[int, ...]:
        return ()

    def rows(
        self, drafter: nn.Module, verified: TargetOutput, positions: torch.Tensor, num_layers: int
    ) -> list[torch.Tensor]:
        return []

    def client_proposer(self, drafter: nn.Module, target: HFTarget) -> Proposer | None:
        return None

    def client_output(self, num_layers: int, tensors: list[torch.Tensor], n: int) -> TargetOutput:
        empty = torch.empty(n, 0)
        return TargetOutput(logits=empty, layer_kv=empty)

    def expected_rows(self, tli: int) -> int:
        return 0


class FinalFeature(TokensOnly):
    """A drafter that reads the target's final (normalised) hidden state (EAGLE, GRIFFIN): the
    server sends it (E values a token); the client holds the drafter's layer, the embeddings
    and the LM head."""

    def hidden_layers(self, drafter: nn.Module, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)

    def rows(
        self, drafter: nn.Module, verified: TargetOutput, positions: torch.Tensor, num_layers: int
    ) -> list[torch.Tensor]:
        return [verified.hidden_states[num_layers]]

    def client_output(self, num_layers: int, tensors: list[torch.Tensor], n: int) -> TargetOutput:
        empty = torch.empty(n, 0)
        return TargetOutput(logits=empty, layer_kv=empty, hidden_states={num_layers: tensors[0]})

    def expected_rows(self, tli: int) -> int:
        return 1
