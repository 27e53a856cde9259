"""MoA under vLLM's tensor parallelism.

Each rank's KV cache holds its share of the target's KV heads (a contiguous block of heads, or,
with fewer KV heads than ranks, one head that several ranks replicate), while LSA reads the K/V
of every head. Each rank therefore runs the whole drafter (it is small; its pages, sized like the
target's per-rank layers, hold its whole K/V on every rank) on the K/V rows all-gathered from the
ranks. The embedding, LM head and TLI layers are the target's own sharded modules, whose
collectives every rank runs in the same order: every rank drafts, and the draft lengths, which
follow each rank's own timings, are rank 0's.
"""

from __future__ import annotations

import torch


def gather_kv_heads(rows: torch.Tensor, num_kv_heads: int, tp: int) -> torch.Tensor:
    """This rank's K|V rows [N, L, w] (per layer `[k_h|v_h]` for its heads) -> the rows of every
    head [N, L, 2 * E_kv], heads in order. Ranks are in head order; with fewer heads than ranks,
    ranks r * tp / num_kv_heads ... hold head r (vLLM's QKVParallelLinear), so one of each is
    kept."""
    from vllm.distributed import tensor_model_parallel_all_gather

    gathered = tensor_model_parallel_all_gather(rows.contiguous(), dim=-1)  # [N, L, tp * w]
    if num_kv_heads >= tp:
        return gathered
    replicas = tp // num_kv_heads
    return gathered.unflatten(-1, (tp, rows.shape[-1]))[:, :, ::replicas].flatten(-2)


def same_on_every_rank(values: list[int]) -> list[int]:
    """Rank 0's `values` on every rank of the tensor-parallel group (same length everywhere)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    tensor = torch.tensor(values, dtype=torch.int64, device=group.device)
    return [int(v) for v in group.broadcast(tensor, src=0).tolist()]


def rank0_value(value: int) -> int:
    """Rank 0's `value` on every rank of the tensor-parallel group, over its CPU group: no
    device synchronisation (the V2 speculator's choice of draft steps)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    box = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(box, src=group.ranks[0], group=group.cpu_group)
    return int(box[0])


def on_every_rank(ok: bool) -> bool:
    """True where `ok` holds on every rank of the tensor-parallel group (over its CPU group): a
    choice every rank must make alike (replay captured graphs or draft eagerly: a rank replaying
    a graph's collectives against one running them eagerly would read stale peer buffers)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    box = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return bool(box[0])
