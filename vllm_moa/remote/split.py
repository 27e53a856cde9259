"""Which half of a drafter runs where, and what crosses the link per verified token.

- MoA, TLI = N: the server runs LSA + mean + Ekv2E and CA's memory K/V projection, and sends
  that K|V (2 E_kv_CA values per token) plus the target's last N layers' K/V (2 E_kv N); the
  client holds SA, CA, the embeddings, the last N layers, the final norm and the LM head.
- EAGLE and GRIFFIN: the server sends the target's final (normalised) hidden state (E values);
  the client holds the drafter's layer (GRIFFIN: and its fusion), the embeddings and the LM head.
- independent: nothing but tokens; the client holds the whole small model.

The paper's message sizes (Table 7) count MoA's memory as 2 E_kv: the CA memory K|V, whose width
is the drafter's, here `2 * ca_num_kv_heads * head_dim`. The client runs the project's own
standalone proposers on these rows (`client_output` turns them into the `TargetOutput` those
proposers read; MoA's memory rows arrive already projected, hence `DeviceMoAProposer`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_moa.checkpoint.io import WEIGHTS_NAME, drafter_dir_of
from vllm_moa.decoding.proposer import Proposer
from vllm_moa.drafters import kind_of
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.factories.proposers import make_proposer
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput, split_kv

FEATURE_KINDS = ("eagle", "griffin")  # drafters reading the target's final hidden state


def fingerprint(drafter_dir: str | Path) -> bytes:
    """8 bytes naming the drafter's weights: client and server must hold the same drafter."""
    digest = hashlib.sha256()
    with open(drafter_dir_of(drafter_dir) / WEIGHTS_NAME, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()[:8]


@dataclass
class ServerHalf:
    """What the server computes from the target's rows for the client's drafter."""

    drafter: nn.Module
    num_layers: int  # the target's L

    @property
    def kind(self) -> str:
        return str(kind_of(self.drafter).name)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Hidden states the server's target pass must return."""
        d = self.drafter
        if isinstance(d, EagleDrafter) or (isinstance(d, MoADrafter) and not d.uses_lsa):
            return (self.num_layers,)
        return ()

    @torch.no_grad()
    def rows(self, verified: TargetOutput, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per verified token (rows of `verified`, at `positions`), the tensors to send, each
        [n, ..., W] (one int8 scale per W-vector)."""
        d = self.drafter
        if isinstance(d, MoADrafter):
            source = verified.layer_kv if d.uses_lsa else verified.hidden_states[self.num_layers]
            memory = d.encode_memory(source.to(d.dtype))
            k, v = d.memory_kv(memory[None], positions)  # [1, Hkv, n, D]
            out = [torch.stack([k[0], v[0]], dim=1).permute(2, 0, 1, 3).flatten(1, 2)]
            if d.config.tli:  # [n, N, 2*Hkv, D]: per layer k_h0, v_h0, k_h1, ...
                tail = verified.layer_kv[:, self.num_layers - d.config.tli :]
                out.append(tail.unflatten(-1, (-1, d.config.target_head_dim)))
            return out  # memory: [n, 2*Hkv (k_h0, v_h0, ...), D]
        if isinstance(d, EagleDrafter):
            return [verified.hidden_states[self.num_layers]]
        return []  # independent: tokens only


class DeviceMoAProposer(MoAProposer):
    """MoA's standalone proposer on the client: the memory rows arrive from the server as CA
    keys/values (`verified.layer_kv`: [n, 2*Hkv, D], heads as k_h0, v_h0, k_h1, ...), so the
    LSA, Ekv2E and K/V projection the local proposer would run have already run there."""

    @torch.no_grad()
    def _extend_memory(self, verified: TargetOutput) -> None:
        rows = verified.layer_kv.flatten(1)[None]  # [1, n, 2*Hkv*D]
        k, v = split_kv(rows, self.drafter.config.ca_num_kv_heads)
        self.memory.update(k.to(self.dtype), v.to(self.dtype), 0)


def client_proposer(drafter: nn.Module, target: HFTarget) -> Proposer:
    if isinstance(drafter, MoADrafter):
        return DeviceMoAProposer(drafter, target)
    return make_proposer(drafter, target)


def client_output(kind: str, num_layers: int, tensors: list[torch.Tensor], n: int) -> TargetOutput:
    """The TargetOutput the client's proposer reads, from the server's rows for n tokens."""
    empty = torch.empty(n, 0)
    if kind == "moa":
        return TargetOutput(logits=empty, layer_kv=tensors[0])
    if kind in FEATURE_KINDS:
        return TargetOutput(logits=empty, layer_kv=empty, hidden_states={num_layers: tensors[0]})
    return TargetOutput(logits=empty, layer_kv=empty)


def expected_rows(kind: str, tli: int) -> int:
    """How many tensors a STARTED / VERIFIED message carries for this drafter."""
    return 1 + (tli > 0) if kind == "moa" else int(kind in FEATURE_KINDS)
