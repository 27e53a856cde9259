"""Which half of a drafter runs where, and what crosses the link per verified token: each kind's
`Split` (drafters/split.py, named in the registry) says; this module asks it.

- MoA, TLI = N: the CA memory K|V and the target's last N layers' K/V (drafters/moa/split.py).
- EAGLE and GRIFFIN: the target's final (normalised) hidden state.
- independent: nothing but tokens.

The client runs the project's own standalone proposers on these rows (its split's
`client_output` turns them into the `TargetOutput` those proposers read; MoA's memory rows
arrive already projected).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vllm_moa.checkpoint.io import WEIGHTS_NAME, drafter_dir_of
from vllm_moa.decoding.proposer import Proposer
from vllm_moa.drafters.split import Split
from vllm_moa.factories.proposers import make_proposer
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.kinds import BY_NAME, kind_of


def fingerprint(drafter_dir: str | Path) -> bytes:
    """8 bytes naming the drafter's weights: client and server must hold the same drafter."""
    digest = hashlib.sha256()
    with open(drafter_dir_of(drafter_dir) / WEIGHTS_NAME, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()[:8]


def split_of(kind: str) -> Split:
    """The registered kind's split (KeyError for an unknown kind name)."""
    split: Split = BY_NAME[kind].load("split")()
    return split


@dataclass
class ServerHalf:
    """What the server computes from the target's rows for the client's drafter."""

    drafter: nn.Module
    num_layers: int  # the target's L
    kind: str = field(init=False)
    split: Split = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.kind = str(kind_of(self.drafter).name)
        self.split = split_of(self.kind)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Hidden states the server's target pass must return."""
        return self.split.hidden_layers(self.drafter, self.num_layers)

    @torch.no_grad()
    def rows(self, verified: TargetOutput, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per verified token (rows of `verified`, at `positions`), the tensors to send, each
        [n, ..., W] (one int8 scale per W-vector)."""
        return self.split.rows(self.drafter, verified, positions, self.num_layers)


def client_proposer(drafter: nn.Module, target: HFTarget) -> Proposer:
    proposer = split_of(kind_of(drafter).name).client_proposer(drafter, target)
    return proposer if proposer is not None else make_proposer(drafter, target)
