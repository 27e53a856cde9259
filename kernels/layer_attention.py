"""LSA's attention over the layer axis: every token attends across its own L layer rows.

q: [N, H, L, D], k/v: [N, Hkv, L, D] (GQA: H % Hkv == 0), full (non-causal) mask over L, tokens
independent. One program per (token, KV head, up to 8192 query elements; 2048 in fp32) stacks the
group's query heads (they all attend to the same L keys, so K and V are loaded once per group)
and holds the whole score tile in registers (L = 32 for Llama-3-8B), so scores never touch
memory. Softmax in fp32; 16-bit inputs feed the tensor cores as they are and the probabilities
are rounded to the input dtype for the P @ V product, as flash attention does (fp32 inputs stay
fp32 throughout).
"""

from __future__ import annotations

import torch

from .common import LOG2_E, check_tile, dot_precision

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
        scale_log2,  # 1/sqrt(D) * log2(e): the softmax runs in base 2
        BLOCK_G: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,  # tl.dot input precision for fp32 inputs ("ieee")
    ):
        n = tl.program_id(0)
        kv_h = tl.program_id(1)
        # query rows: BLOCK_G heads of this KV head's group, L layers each, stacked; they all
        # attend to the same L keys, so one K/V tile serves the whole group
        rows = tl.arange(0, BLOCK_G * BLOCK_L)
        g = tl.program_id(2) * BLOCK_G + rows // BLOCK_L
        layer = rows % BLOCK_L
        head = kv_h * groups + g
        keys = tl.arange(0, BLOCK_L)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < head_dim
        row_ok = (g < groups) & (layer < num_layers)
        key_ok = keys < num_layers
        q_at = n * stride_qn + head[:, None] * stride_qh + layer[:, None] * stride_ql
        q = tl.load(q_ptr + q_at + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        kv_mask = key_ok[:, None] & col_ok[None, :]
        k = tl.load(
            k_ptr + n * stride_kn + kv_h * stride_kh + keys[:, None] * stride_kl + cols[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + n * stride_vn + kv_h * stride_vh + keys[:, None] * stride_vl + cols[None, :],
            mask=kv_mask,
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G*L, L]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        p = tl.exp2(scores - tl.max(scores, axis=1)[:, None])
        denominator = tl.sum(p, axis=1)
        out = tl.dot(p.to(v.dtype), v, input_precision=PRECISION) / denominator[:, None]
        o_at = n * stride_on + head[:, None] * stride_oh + layer[:, None] * stride_ol
        tl.store(
            o_ptr + o_at + cols[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def default_block_g(groups: int, block_l: int, block_d: int, element_size: int) -> int:
    """Query heads per program: query tiles of at most 8192 elements for 16-bit inputs (Llama-3-8B's
    LSA, D=64: 4 heads x 32 layers), 2048 for fp32, whose q, scores and output tiles all take
    32-bit registers. Read off the compiler (benchmarks/kernels_aot.py): these build without
    register spills on Hopper and Ampere (bf16, 4 heads: 113 registers per thread on sm_90;
    fp32 with 4 heads spilled 808 bytes, with 2 heads still 88 at 7 heads per group)."""
    budget = 8192 if element_size <= 2 else 2048
    return min(triton.next_power_of_2(groups), max(1, budget // (block_l * block_d)))


def layer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_g: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Validated launch of the Triton kernel; shapes as in the module docstring. block_g (query
    heads per program) and num_warps are for benchmarks/kernels_gpu.py's sweep; callers keep
    the defaults."""
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
    hkv, groups = k.shape[1], h // k.shape[1]
    if block_g is None:
        block_g = default_block_g(groups, block_l, block_d, q.element_size())
    check_tile("block_g", block_g, 1)
    _layer_attention_kernel[(n, hkv, triton.cdiv(groups, block_g))](
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
        groups,
        d**-0.5 * LOG2_E,
        BLOCK_G=block_g,
        BLOCK_L=block_l,
        BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
    )
    return out
