"""Paged drafting attention: vLLM's CPU ops over our page views equal the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from vllm_moa.vllm_plugin.paged_attention import (
    PADDING_SLOT,
    CpuPagedKV,
    TorchPagedKV,
    fits_one_layer,
    page_views,
)


def _fill(store, num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """Write random K/V to every slot but a few (padding slots) outside block 0 (vLLM's null
    block, where the reference writes padding); returns the slots."""
    slots = block_size + torch.randperm((num_blocks - 1) * block_size, generator=gen)
    slots[:5] = PADDING_SLOT
    k = torch.randn(slots.numel(), store.num_kv_heads, store.head_dim, generator=gen)
    v = torch.randn(slots.numel(), store.num_kv_heads, store.head_dim, generator=gen)
    store.write(k, v, slots)
    return slots


@pytest.mark.parametrize(
    "target_heads, target_dim, heads, dim, query_heads, window",
    [
        (2, 64, 1, 64, 2, None),  # the test pair's SA/CA: half the target's KV heads
        (2, 64, 2, 64, 8, None),  # as wide as a target layer, GQA 4
        (1, 64, 2, 32, 4, None),  # another head size: blocks reinterpreted
        (2, 64, 2, 64, 2, 37),  # a sliding window (the target's tail layers)
    ],
)
def test_cpu_ops_match_the_reference(target_heads, target_dim, heads, dim, query_heads, window):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size = 12, 32
    shape = (num_blocks, target_heads, block_size, 2 * target_dim)
    cpu_cache, ref_cache = torch.zeros(shape), torch.zeros(shape)
    cpu = CpuPagedKV.for_pages(cpu_cache, heads, dim, torch.float32, "pages")
    ref = TorchPagedKV(*page_views(ref_cache, heads, dim))
    _fill(cpu, num_blocks, block_size, torch.Generator().manual_seed(1))
    _fill(ref, num_blocks, block_size, torch.Generator().manual_seed(1))
    rows = 5
    table = 1 + torch.stack(
        [torch.randperm(num_blocks - 1, generator=gen)[:4] for _ in range(rows)]
    )
    table = table.to(torch.int32)
    seq_lens = torch.tensor([1, 31, 32, 77, 128], dtype=torch.int32)
    q = torch.randn(rows, query_heads, dim, generator=gen)
    got = cpu.attend(q, table, seq_lens, window)
    want = ref.attend(q, table, seq_lens, window)
    # fp32 on both sides, softmax over <= 128 keys: agreement to rounding.
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_padding_slots_are_not_written():
    cache = torch.zeros(4, 2, 32, 128)
    store = CpuPagedKV.for_pages(cache, 2, 64, torch.float32, "pages")
    k = torch.ones(3, 2, 64)
    store.write(k, k, torch.tensor([PADDING_SLOT, 5, PADDING_SLOT]))
    assert cache.count_nonzero() == 2 * 2 * 64  # one slot's K and V, both heads


def test_fields_wider_than_a_target_layer_are_refused():
    assert fits_one_layer(2, 64, 2, 64) and fits_one_layer(1, 64, 2, 32)
    assert not fits_one_layer(1, 64, 2, 64) and not fits_one_layer(2, 64, 1, 96)
    with pytest.raises(ValueError, match="too few for 4 heads of 64"):
        page_views(torch.zeros(2, 2, 32, 128), 4, 64)
