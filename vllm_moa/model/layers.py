"""Building blocks of the drafter: RMSNorm, rotary embeddings, GQA attention, SwiGLU, decoder block.

Shapes: B batch (tokens for LSA), T queries, S keys, H query heads, Hkv KV heads, D head size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_moa.model.rope import apply_rope, rope_cos_sin, scaled_cos_sin, scaled_frequencies
from vllm_moa.switches import env_switch


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as Llama does; cast back so bf16 weights keep bf16 activations.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention with grouped KV heads.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: bool, broadcastable to [B, H, T, S], True = may
    attend. A query row with no visible key outputs zeros (instead of NaN), so fully masked rows
    are safe in training too. With gradients: the fp32 reference below; without (drafting):
    PyTorch's fused SDPA, which does not copy the grouped K/V per query head (the same result to
    fp32 rounding; tests compare the two).
    """
    if not torch.is_grad_enabled():
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
        )
        if mask is not None:  # rows with no visible key: SDPA gives NaN there
            out = out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
        return out
    return reference_attention(q, k, v, mask)


KERNELS_ENV = "VLLM_MOA_KERNELS"


def use_kernels(device: torch.device) -> bool:
    """Whether inference uses our Triton kernels: `auto` (default) on CUDA devices when Triton is
    installed; `1` forces them anywhere (tests run them on the CPU under TRITON_INTERPRET=1);
    `0` never (the PyTorch paths)."""
    switch = env_switch(KERNELS_ENV)
    if switch is not None:
        return switch
    if device.type != "cuda":
        return False
    from vllm_moa.kernels.layer_attention import triton

    return triton is not None


def layer_axis_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """LSA's full (unmasked) attention over the layer axis, q [N, H, L, D], k/v [N, Hkv, L, D]:
    the Triton kernel when drafting on CUDA (see `use_kernels`), masked_attention otherwise
    (always when training: the kernel has no backward)."""
    if not torch.is_grad_enabled() and use_kernels(q.device):
        from vllm_moa.kernels.layer_attention import layer_attention

        return layer_attention(q, k, v)
    return masked_attention(q, k, v, None)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """masked_attention in fp32, written out (differentiable on fully masked rows)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is None:
        probs = scores.softmax(dim=-1)
    else:
        # A finite fill keeps gradients finite on empty rows; multiplying by the mask zeroes them.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1) * mask
    return torch.matmul(probs.to(v.dtype), v)


class Attention(nn.Module):
    """GQA attention whose keys/values may come from another stream (self or cross attention)."""

    rope_inv_freq_bits: torch.Tensor  # [D/2] int32, a buffer registered with rope scaling only

    def __init__(
        self,
        width: int,
        num_heads: int,
        num_kv_heads: int,
        rope_theta: float,
        over_layers: bool = False,
        rope_scaling: Mapping[str, Any] | None = None,
        in_width: int | None = None,
    ) -> None:
        """`rope_scaling`: a target's RoPE scaling (model/rope.py's rope_scaling_of), None for
        plain RoPE over `rope_theta`. `in_width`: the width q, k and v are projected from when
        it is not `width` (EAGLE-3's attention reads [embedding | feature], 2 * width); the
        heads and the output stay at `width`."""
        super().__init__()
        in_width = width if in_width is None else in_width
        self.over_layers = over_layers  # LSA: unmasked attention over a short layer axis
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = width // num_heads
        self.rope_theta = rope_theta
        self.rope_scaling = None if rope_scaling is None else dict(rope_scaling)
        self.rope_factor = 1.0  # the scaling's cos/sin factor (YaRN's attention factor)
        if rope_scaling is not None:
            inv_freq, self.rope_factor = scaled_frequencies(self.head_dim, rope_theta, rope_scaling)
            # [D/2] float32 kept as its int32 bit pattern: `.to(dtype)` rounds floating buffers
            # (bf16 would move the frequencies) but only moves integer ones. Not in state_dict.
            self.register_buffer("rope_inv_freq_bits", inv_freq.view(torch.int32), persistent=False)
        self.q_proj = nn.Linear(in_width, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, width, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.head_dim)).transpose(1, 2)  # [B, n, S, D]

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., S, D] of this block's rotary embedding at positions [..., S]."""
        if self.rope_scaling is None:
            return rope_cos_sin(positions, self.head_dim, self.rope_theta, dtype)
        inv_freq = self.rope_inv_freq_bits.view(torch.float32)
        return scaled_cos_sin(positions, inv_freq, self.rope_factor, dtype)

    def project_kv(
        self, source: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """source: [B, S, W] (already normalised), positions: [S] -> k, v: [B, Hkv, S, D]."""
        k = self._heads(self.k_proj(source), self.num_kv_heads)
        v = self._heads(self.v_proj(source), self.num_kv_heads)
        cos, sin = self.cos_sin(positions, k.dtype)
        return apply_rope(k, cos, sin), v

    def project_q(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, T, W] (already normalised), positions: [T] or [B, T] -> q: [B, H, T, D]."""
        q = self._heads(self.q_proj(x), self.num_heads)
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rope(q, cos, sin)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, W], already normalised
        positions: torch.Tensor,  # [T], or [B, T] per row
        k: torch.Tensor,  # [B, Hkv, S, D]
        v: torch.Tensor,  # [B, Hkv, S, D]
        mask: torch.Tensor | None,  # bool [T, S] or [B, 1, T, S]; None = full
    ) -> torch.Tensor:
        q = self.project_q(x, positions)
        if self.over_layers and mask is None:
            out = layer_axis_attention(q, k, v)
        else:
            out = masked_attention(q, k, v, mask)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).flatten(-2))


# Attention supplied to `DecoderBlock.step`: (q [N, H, D], the rows' own k, v [N, Hkv, D] or
# None) -> [N, H, D].
Attend = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


class SwiGLU(nn.Module):
    def __init__(self, width: int, intermediate: int, out_width: int | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, intermediate, bias=False)
        self.up_proj = nn.Linear(width, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, out_width or width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm decoder layer (Llama layout) whose attention keys may come from any stream.

    For self-attention the keys are `kv_from(x)`; for cross-attention they are `kv_from(memory)`:
    `input_layernorm` is shared by the query and the key/value streams, as in the MoA release.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate: int,
        rope_theta: float,
        eps: float,
        input_norm: bool = True,
        over_layers: bool = False,
        mlp_out_width: int | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
    ) -> None:
        """`mlp_out_width`: the MLP's output width when it differs from `width` (GRIFFIN's
        token-enhanced head writes two states; that block's forward adds the residual).
        `rope_scaling`: the attention's RoPE scaling (see `Attention`), None for plain RoPE."""
        super().__init__()
        # EAGLE's layer has no input norm: its input is already an fc projection.
        self.input_layernorm: nn.Module = RMSNorm(width, eps) if input_norm else nn.Identity()
        self.self_attn = Attention(
            width, num_heads, num_kv_heads, rope_theta, over_layers, rope_scaling
        )
        self.post_attention_layernorm = RMSNorm(width, eps)
        self.mlp = SwiGLU(width, intermediate, mlp_out_width)

    @property
    def dtype(self) -> torch.dtype:
        return self.post_attention_layernorm.weight.dtype

    def kv_from(
        self, source: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """source: [B, S, W] -> k, v: [B, Hkv, S, D] (normalised, projected, rotated)."""
        return self.self_attn.project_kv(self.input_layernorm(source), positions)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, W]
        positions: torch.Tensor,  # [T], or [B, T] per row
        k: torch.Tensor,  # [B, Hkv, S, D]
        v: torch.Tensor,  # [B, Hkv, S, D]
        mask: torch.Tensor | None,  # bool [T, S] or [B, 1, T, S]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(
        self,
        x: torch.Tensor,  # [B, W]: one new token per row
        positions: torch.Tensor,  # [B]
        attend: Attend,
        self_kv: bool = True,
    ) -> torch.Tensor:
        """The block on one token per row with attention supplied by the caller, who owns the
        keys and values (dense, paged, ...): `attend(q [B, H, D], k, v)` returns [B, H, D],
        where k, v [B, Hkv, D] are the new token's own (with `self_kv`; else None)."""
        attn = self.self_attn
        normed = self.input_layernorm(x)[:, None]  # [B, 1, W]
        q = attn.project_q(normed, positions[:, None])[:, :, 0]
        k = v = None
        if self_kv:
            k, v = attn.project_kv(normed, positions[:, None])
            k, v = k[:, :, 0], v[:, :, 0]
        out = attend(q, k, v)
        x = x + attn.o_proj(out.flatten(1).to(x.dtype))
        return x + self.mlp(self.post_attention_layernorm(x))


def count_parameters(module: nn.Module) -> dict[str, int]:
    """Trainable parameter counts per top-level child and in total."""
    out = {
        name: sum(p.numel() for p in child.parameters()) for name, child in module.named_children()
    }
    out["total"] = sum(out.values())
    return out
