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
