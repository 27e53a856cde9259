"""Tree-masked verification attention over a paged KV prefix.

Per request b: the queries are the draft tree's nodes q[b, :num_nodes[b]]; the keys are the
request's verified prefix (prefix_lens[b] tokens in a paged cache, pages listed in
block_table[b]) followed by the tree nodes themselves, of which node i sees node j only when
tree_mask[b, i, j] (j is i or an ancestor of i). GQA; fp32 online softmax (flash-attention
style); variable prefix and tree sizes across the batch.

One program per (request, KV head, 64 rows), a row being a (node, query head) pair of that KV
head's group: each K/V tile (64 keys; fp32 tiles are smaller, see `default_tiles`) is loaded once
for the group, not once per query head (the design aims at "<= 1.2x unmasked attention over
the same tokens"; GPU timing in benchmarks/kernels_gpu.py). 16-bit inputs feed the tensor
cores as they are, and the probabilities are rounded to the input dtype for the P @ V product as
flash attention does (fp32 inputs stay fp32 throughout).

Shapes: q [B, M, H, D]; k_tree, v_tree [B, M, Hkv, D]; tree_mask [B, M, M] bool;
num_nodes [B]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [B, max_blocks];
prefix_lens [B]. Output [B, M, H, D] (rows >= num_nodes[b] are zeros).
"""

from __future__ import annotations

import torch

from .common import LOG2_E, check_tile, dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference below still works
    triton = None


def tree_attention_ref(
    q: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor,
    num_nodes: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> torch.Tensor:
    """Plain PyTorch, one request at a time: gather the prefix pages, then masked softmax."""
    out = torch.zeros_like(q)
    block_size = k_cache.shape[1]
    groups = q.shape[2] // k_cache.shape[2]
    for b in range(q.shape[0]):
        n, p = int(num_nodes[b]), int(prefix_lens[b])
        slots = torch.arange(p, device=q.device)
        pages = block_table[b, slots // block_size].long()
        k = torch.cat([k_cache[pages, slots % block_size], k_tree[b, :n]])  # [P+n, Hkv, D]
        v = torch.cat([v_cache[pages, slots % block_size], v_tree[b, :n]])
        allowed = torch.cat(
            [torch.ones(n, p, dtype=torch.bool, device=q.device), tree_mask[b, :n, :n]], dim=1
        )  # [n, P+n]
        k = k.repeat_interleave(groups, dim=1).float().transpose(0, 1)  # [H, P+n, D]
        v = v.repeat_interleave(groups, dim=1).float().transpose(0, 1)
        scores = q[b, :n].float().transpose(0, 1) @ k.transpose(1, 2) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[b, :n] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr):
        """Fold one K/V tile into the running max m_i, sum l_i and output acc of every row,
        keys where `visible` is false left out (flash attention's online softmax, base 2)."""
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows with nothing visible yet keep m = -inf: guard the exp of (-inf) - (-inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _tree_attention_kernel(
        q_ptr,
        kt_ptr,
        vt_ptr,
        mask_ptr,
        nodes_ptr,  # q [B,M,H,D]; k/v tree [B,M,Hkv,D]; [B,M,M]; [B]
        kc_ptr,
        vc_ptr,
        table_ptr,
        plen_ptr,  # caches [NB,BS,Hkv,D]; table [B,MB]; [B]
        o_ptr,  # [B, M, H, D]
        s_qb,
        s_qm,
        s_qh,
        s_tb,
        s_tm,
        s_th,
        s_mb,
        s_mi,
        s_cb,
        s_cs,
        s_ch,
        s_bt,
        s_ob,
        s_om,
        s_oh,
        head_dim,
        groups,
        block_size,
        scale_log2,  # 1/sqrt(D) * log2(e): the softmax runs in base 2
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,  # tl.dot input precision for fp32 inputs ("ieee")
    ):
        b = tl.program_id(0)
        kv_h = tl.program_id(1)
        # rows are (node, query head of this KV head's group) pairs: the group's heads share
        # every K/V tile, which is loaded once for all of them
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        node = rows // groups
        head = kv_h * groups + rows % groups
        cols = tl.arange(0, BLOCK_D)
        num_nodes = tl.load(nodes_ptr + b)
        prefix = tl.load(plen_ptr + b)
        row_ok = node < num_nodes
        col_ok = cols < head_dim
        q = tl.load(
            q_ptr + b * s_qb + node[:, None] * s_qm + head[:, None] * s_qh + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # 1) the verified prefix: every node sees all of it
        for start in range(0, prefix, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < prefix
            page = tl.load(table_ptr + b * s_bt + j // block_size, mask=j_ok, other=0)
            slot = page.to(tl.int64) * s_cb + (j % block_size) * s_cs + kv_h * s_ch
            kv_ok = j_ok[:, None] & col_ok[None, :]
            k = tl.load(kc_ptr + slot[:, None] + cols[None, :], mask=kv_ok, other=0.0)
            v = tl.load(vc_ptr + slot[:, None] + cols[None, :], mask=kv_ok, other=0.0)
            m_i, l_i, acc = _online_softmax_step(
                q, k, v, j_ok[None, :], m_i, l_i, acc, scale_log2, PRECISION
            )
        # 2) the tree nodes, under the ancestor mask
        for start in range(0, num_nodes, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < num_nodes
            kv_ok = j_ok[:, None] & col_ok[None, :]
            at = b * s_tb + j * s_tm + kv_h * s_th
            k = tl.load(kt_ptr + at[:, None] + cols[None, :], mask=kv_ok, other=0.0)
            v = tl.load(vt_ptr + at[:, None] + cols[None, :], mask=kv_ok, other=0.0)
            allowed = tl.load(
                mask_ptr + b * s_mb + node[:, None] * s_mi + j[None, :],
                mask=row_ok[:, None] & j_ok[None, :],
                other=0,
            )
            m_i, l_i, acc = _online_softmax_step(
                q, k, v, allowed != 0, m_i, l_i, acc, scale_log2, PRECISION
            )
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + b * s_ob + node[:, None] * s_om + head[:, None] * s_oh + cols[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def default_tiles(element_size: int, block_d: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps): the largest tiles whose builds for Hopper (sm_90) and
    Ampere (sm_80) spill no registers, read off the compiler (benchmarks/kernels_aot.py,
    results/kernels/kernels_aot.json; GPU timing pending). 16-bit: 64 rows x 64 keys on the tensor
    cores, 8 warps at head size 128 (with 4 warps Hopper's build spills: 255 registers per
    thread; with 8, 202 and no spills), 4 at 64. fp32 products run in full precision on the FMA
    units, whose operand layouts take far more registers: 16 rows x 16 keys, 4 warps (64 x 32,
    the earlier default, spilled 9.7 KB per thread on Hopper at head size 128)."""
    if element_size <= 2:
        return 64, 64, 8 if block_d >= 128 else 4
    return 16, 16, 4


def tree_attention(
    q: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor,
    num_nodes: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Validated launch of the Triton kernel; shapes as in the module docstring. The tiles
    (block_m rows of (node, head) pairs, block_n keys) and warps are for the benchmarks' sweeps;
    callers keep the defaults (`default_tiles`)."""
    if triton is None:
        raise RuntimeError(
            "tree_attention needs Triton (pip install triton); use tree_attention_ref"
        )
    bsz, m, h, d = q.shape
    if k_tree.shape != v_tree.shape or k_tree.shape[:2] != (bsz, m) or k_tree.shape[3] != d:
        raise ValueError(f"k_tree/v_tree {tuple(k_tree.shape)} do not match q {tuple(q.shape)}")
    if tree_mask.shape != (bsz, m, m) or tree_mask.dtype != torch.bool:
        raise ValueError(
            f"tree_mask must be bool [{bsz}, {m}, {m}], "
            f"got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k_tree.shape[2:]:
        raise ValueError(
            f"k_cache/v_cache {tuple(k_cache.shape)} must be "
            f"[blocks, block_size, {k_tree.shape[2]}, {d}]"
        )
    if h % k_tree.shape[2]:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {k_tree.shape[2]}")
    if num_nodes.shape != (bsz,) or prefix_lens.shape != (bsz,) or block_table.shape[0] != bsz:
        raise ValueError("num_nodes, prefix_lens and block_table need one row per request")
    q, k_tree, v_tree, k_cache, v_cache = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_tree, v_tree, k_cache, v_cache)
    )
    mask = tree_mask.to(torch.int8).contiguous()
    table = block_table.to(torch.int32).contiguous()
    out = torch.zeros_like(q)
    if bsz == 0 or m == 0:
        return out
    hkv = k_tree.shape[2]
    block_d = max(16, triton.next_power_of_2(d))
    tiles = default_tiles(q.element_size(), block_d)
    block_m = check_tile("block_m", tiles[0] if block_m is None else block_m, 16)
    block_n = check_tile("block_n", tiles[1] if block_n is None else block_n, 16)
    _tree_attention_kernel[(bsz, hkv, triton.cdiv(m * (h // hkv), block_m))](
        q,
        k_tree,
        v_tree,
        mask,
        num_nodes.to(torch.int32).contiguous(),
        k_cache,
        v_cache,
        table,
        prefix_lens.to(torch.int32).contiguous(),
        out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_tree.stride(0),
        k_tree.stride(1),
        k_tree.stride(2),
        mask.stride(0),
        mask.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        d,
        h // hkv,
        k_cache.shape[1],
        d**-0.5 * LOG2_E,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
        num_warps=tiles[2] if num_warps is None else num_warps,
    )
    return out
