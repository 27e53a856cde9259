"""Pure parts of the drafter's paged state (no vLLM needed): page views and uploads."""

from __future__ import annotations

import pytest
import torch

from vllm_moa.vllm_plugin.paged_attention import page_views


def test_page_views_take_any_dense_layout():
    """Page views cover the layer's buffer in memory order, whatever permutation vLLM binds;
    K and V of a slot are written through to the buffer and nothing else is."""
    base = torch.zeros(2, 3, 4, 8)  # e.g. a (2, blocks, block, width) buffer, bound permuted
    cache = base.permute(1, 0, 2, 3)  # [3 blocks, 2 heads, 4 slots, 8]
    key, value = page_views(cache, num_kv_heads=2, head_dim=4)
    assert key.shape == value.shape == (3, 2, 4, 4)
    key[2, :, 1] = 1.0
    value[2, :, 1] = 2.0
    assert base.sum() == 8 + 16
    with pytest.raises(RuntimeError, match="not one dense buffer"):
        page_views(base[:, :2].permute(1, 0, 2, 3), num_kv_heads=1, head_dim=4)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
def test_upload_copies_host_ints_to_the_device(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vllm_moa.vllm_plugin.uploads import upload

    ids = upload([3, 1, 2], device)
    assert ids.device.type == device and ids.dtype == torch.long
    assert ids.cpu().tolist() == [3, 1, 2]
    host = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    moved = upload(host, device)
    assert moved.dtype == torch.int32 and torch.equal(moved.cpu(), host)


@pytest.mark.parametrize(
    "heads, dim, query_heads, dtype",
    [
        (1, 64, 2, torch.float32),  # the test pair's SA / CA
        (2, 64, 8, torch.float32),  # GQA 4
        (2, 32, 2, torch.float16),  # 16-bit pages (tensor-core path on a GPU)
    ],
)
def test_triton_store_reads_pages_in_place_like_the_reference(heads, dim, query_heads, dtype):
    """The GPU layouts' store (the paged Triton kernel, here under TRITON_INTERPRET) equals the
    PyTorch reference on random pages: ragged lengths, page boundaries, shuffled block tables."""
    from vllm_moa.vllm_plugin.paged_attention import TorchPagedKV, TritonPagedKV

    gen = torch.Generator().manual_seed(heads * dim)
    num_blocks, block_size = 10, 16
    cache = torch.randn(num_blocks, heads, block_size, 2 * dim, generator=gen).to(dtype)
    ref = TorchPagedKV(*page_views(cache, heads, dim))
    kernel = TritonPagedKV(*page_views(cache, heads, dim))
    seq_lens = torch.tensor([1, 16, 17, 50, 64], dtype=torch.int32)
    table = torch.stack([torch.randperm(num_blocks, generator=gen)[:4] for _ in seq_lens])
    q = torch.randn(len(seq_lens), query_heads, dim, generator=gen).to(dtype)
    got = kernel.attend(q, table.to(torch.int32), seq_lens)
    want = ref.attend(q, table.to(torch.int32), seq_lens)
    assert got.dtype == q.dtype and got.shape == q.shape
    # fp32: both accumulate in fp32 over <= 64 keys (rounding only). fp16: the kernel rounds the
    # probabilities to fp16 for P @ V as flash attention does; the reference's SDPA rounds
    # differently: a few fp16 ulps at outputs of magnitude <= ~3.
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_gpu_layouts_pick_the_kernel_store_when_kernels_are_on(monkeypatch):
    from vllm_moa.vllm_plugin.paged_attention import TorchPagedKV, TritonPagedKV, pages_kv

    cache = torch.zeros(3, 2, 16, 128)
    monkeypatch.setenv("VLLM_MOA_KERNELS", "1")
    assert type(pages_kv(cache, 2, 64, torch.float32, "FLASH_ATTN")) is TritonPagedKV
    monkeypatch.setenv("VLLM_MOA_KERNELS", "0")
    assert type(pages_kv(cache, 2, 64, torch.float32, "FLASH_ATTN")) is TorchPagedKV
