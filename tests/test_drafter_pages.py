"""Pure parts of the drafter's paged state (no vLLM needed): field planning and slot grids."""

from __future__ import annotations

import pytest
import torch

from vllm_moa.vllm_plugin.pages import plan_fields, slot_grid


def test_fields_take_whole_layers_each():
    fields = plan_fields({"memory": 256, "sa": 300, "x": 1}, row_width=256)
    assert [(f.name, f.first_layer, f.num_layers) for f in fields] == [
        ("memory", 0, 1),
        ("sa", 1, 2),
        ("x", 3, 1),
    ]


def test_slot_grid_follows_each_block_table():
    grid = slot_grid([[5, 2], [7]], block_size=4, width=6, device=torch.device("cpu"))
    assert grid[0].tolist() == [20, 21, 22, 23, 8, 9]
    # past a request's blocks: its first block (garbage rows, masked by length)
    assert grid[1].tolist() == [28, 29, 30, 31, 28, 29]


def test_rows_view_any_dense_layout():
    """Page rows are a view of the layer's buffer whatever the permutation vLLM binds."""
    from types import SimpleNamespace

    from vllm_moa.vllm_plugin.pages import DrafterPages

    pages = DrafterPages.__new__(DrafterPages)
    pages.row_width = 8
    base = torch.zeros(2, 3, 4, 2)  # e.g. a (2, blocks, block, width) buffer, bound permuted
    pages.layers = [SimpleNamespace(kv_cache=base.permute(1, 0, 2, 3), layer_name="p.0")]
    rows = pages._rows(0)
    assert rows.shape == (6, 8)
    rows[5] = 1.0
    assert base.sum() == 8  # written through to the buffer
    pages.layers = [SimpleNamespace(kv_cache=base[:, :2], layer_name="p.0")]  # not dense
    with pytest.raises(RuntimeError, match="not one dense buffer"):
        pages._rows(0)


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
