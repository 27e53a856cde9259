"""MoA's client-server split (drafters/split.py): with TLI = N the server runs LSA + mean +
Ekv2E and CA's memory K/V projection and sends that K|V (2 E_kv_CA values a token) plus the
target's last N layers' K/V (2 E_kv N); the client holds SA, CA, the embeddings, the last N
layers, the final norm and the LM head. The paper's message sizes (Table 7) count MoA's memory
as 2 E_kv: the CA memory K|V, whose width is the drafter's, `2 * ca_num_kv_heads * head_dim`.
A -LSA drafter's memory comes from the target's final hidden state instead."""

from __future__ import annotations

import torch
from torch import nn

from vllm_moa.decoding.proposer import Proposer
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput, split_kv


class DeviceMoAProposer(MoAProposer):
    """MoA's standalone proposer on the client: the memory rows arrive from the server as CA
    keys/values (`verified.layer_kv`: [n, 2*Hkv, D], heads as k_h0, v_h0, k_h1, ...), so the
    LSA, Ekv2E and K/V projection the local proposer would run have already run there."""

    @torch.no_grad()
    def _extend_memory(self, verified: TargetOutput) -> None:
        rows = verified.layer_kv.flatten(1)[None]  # [1, n, 2*Hkv*D]
        k, v = split_kv(rows, self.drafter.config.ca_num_kv_heads)
        self.memory.update(k.to(self.dtype), v.to(self.dtype), 0)


class MoASplit:
    def hidden_layers(self, drafter: nn.Module, num_layers: int) -> tuple[int, ...]:
        assert isinstance(drafter, MoADrafter)
        return () if drafter.uses_lsa else (num_layers,)

    @torch.no_grad()
    def rows(
        self, drafter: nn.Module, verified: TargetOutput, positions: torch.Tensor, num_layers: int
    ) -> list[torch.Tensor]:
        d = drafter
        assert isinstance(d, MoADrafter)
        source = verified.layer_kv if d.uses_lsa else verified.hidden_states[num_layers]
        memory = d.encode_memory(source.to(d.dtype))
        k, v = d.memory_kv(memory[None], positions)  # [1, Hkv, n, D]
        out = [torch.stack([k[0], v[0]], dim=1).permute(2, 0, 1, 3).flatten(1, 2)]
        if d.config.tli:  # [n, N, 2*Hkv, D]: per layer k_h0, v_h0, k_h1, ...
            tail = verified.layer_kv[:, num_layers - d.config.tli :]
            out.append(tail.unflatten(-1, (-1, d.config.target_head_dim)))
        return out  # memory: [n, 2*Hkv (k_h0, v_h0, ...), D]

    def client_proposer(self, drafter: nn.Module, target: HFTarget) -> Proposer | None:
        assert isinstance(drafter, MoADrafter)
        return DeviceMoAProposer(drafter, target)

    def client_output(self, num_layers: int, tensors: list[torch.Tensor], n: int) -> TargetOutput:
        return TargetOutput(logits=torch.empty(n, 0), layer_kv=tensors[0])

    def expected_rows(self, tli: int) -> int:
        return 1 + (tli > 0)
