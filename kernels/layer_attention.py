"""LSA's attention over the layer axis: every token attends across its own L layer rows.

q: [N, H, L, D], k/v: [N, Hkv, L, D] (GQA: H % Hkv == 0), full (non-causal) mask over L, tokens
independent. One program per (token, head) holds the whole L x L score tile in registers
(L = 32 for Llama-3-8B), so scores never touch memory. Softmax in fp32.
"""

from __future__ import annotations

import torch
from vllm_moa.kernels.common import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference below still works
    triton = None


def layer_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: softmax(q k^T / sqrt(D)) v over the layer axis, fp32 softmax."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


if triton is not None:

    @triton.jit
    def _layer_attention_kernel(
        q_ptr,  # [N, H, L, D]
        k_ptr,  # [N, Hkv, L, D]
        v_ptr,  # [N, Hkv, L, D]
        o_ptr,  # [N, H, L, D]
        stride_qn,
        stride_qh,
        stride_ql,
        stride_kn,
        stride_kh,
        stride_kl,
        stride_vn,
        stride_vh,
        stride_vl,
        stride_on,
        stride_oh,
        stride_ol,
        num_layers,
        head_dim,
        groups,
        scale,
        BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 models, else "tf32"
    ):
        n = tl.program_id(0)
        h = tl.program_id(1)
        kv_h = h // groups
        rows = tl.arange(0, BLOCK_L)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < num_layers
        tile_ok = row_ok[:, None] & (cols[None, :] < head_dim)
        q = tl.load(
            q_ptr + n * stride_qn + h * stride_qh + rows[:, None] * stride_ql + cols[None, :],
            mask=tile_ok,
            other=0.0,
        )
        k = tl.load(
            k_ptr + n * stride_kn + kv_h * stride_kh + rows[:, None] * stride_kl + cols[None, :],
            mask=tile_ok,
            other=0.0,
        )
        v = tl.load(
            v_ptr + n * stride_vn + kv_h * stride_vh + rows[:, None] * stride_vl + cols[None, :],
            mask=tile_ok,
            other=0.0,
        )
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        scores = scores * scale  # [L, L]
        scores = tl.where(row_ok[None, :], scores, float("-inf"))
        scores = scores - tl.max(scores, axis=1)[:, None]
        p = tl.exp(scores)
        p = p / tl.sum(p, axis=1)[:, None]
        out = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        tl.store(
            o_ptr + n * stride_on + h * stride_oh + rows[:, None] * stride_ol + cols[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=tile_ok,
        )


def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Validated launch of the Triton kernel; shapes as in the module docstring."""
    if triton is None:
        raise RuntimeError(
            "layer_attention needs Triton (pip install triton); use layer_attention_ref"
        )
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"expected q [N, H, L, D] and k, v [N, Hkv, L, D]; got {q.shape}, {k.shape}, {v.shape}"
        )
    n, h, layers, d = q.shape
    if k.shape[0] != n or k.shape[2] != layers or k.shape[3] != d:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {k.shape[1]}")
    if not (q.device == k.device == v.device) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError("q, k, v must share device and dtype")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    if n == 0:
        return out
    block_l = max(16, triton.next_power_of_2(layers))  # tl.dot needs >= 16
    block_d = max(16, triton.next_power_of_2(d))
    _layer_attention_kernel[(n, h)](
        q,
        k,
        v,
        out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        layers,
        d,
        h // k.shape[1],
        d**-0.5,
        BLOCK_L=block_l,
        BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
    )
    return out
