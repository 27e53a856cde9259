"""A GPU start-up cannot index host tensors with device ones: the compiled step's warm-up (stand-in
pages of the store class serving uses, block tables, positions, every input) runs here on the
`meta` device, standing in for CUDA, under a dispatch mode that fails on any op whose tensors
sit on two devices (0-dim host scalars aside, which PyTorch moves itself). The warm-up used to
allocate its stand-in pages on the host whatever the proposer's device: the control shows the
check catches exactly that."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.conftest import make_hf_model
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.hf_target import HFTarget
from vllm_moa.model.presets import TargetInfo, make_config
from vllm_moa.vllm_plugin.drafting import page_rows, paged_draft_step, warm_up
from vllm_moa.vllm_plugin.paged_attention import TorchPagedKV
from vllm_moa.vllm_plugin.pages import DrafterPages

pytestmark = [pytest.mark.vllm]


class OneDevice(TorchDispatchMode):
    """Fails on any op whose tensor arguments sit on more than one device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        devices = {
            t.device.type
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)
        }
        if len(devices) > 1:
            raise AssertionError(f"{func} mixes devices {sorted(devices)}")
        return func(*args, **kwargs)


def _pages(drafter: MoADrafter, target: HFTarget) -> DrafterPages:
    """DrafterPages as the core declares them, without vLLM's attention layers behind them."""
    sa, ca = drafter.self_attention.self_attn, drafter.cross_attention.self_attn
    pages = object.__new__(DrafterPages)
    pages.fields = {"memory": (ca.num_kv_heads, ca.head_dim), "sa": (sa.num_kv_heads, sa.head_dim)}
    like = SimpleNamespace(num_kv_heads=target.shape.num_kv_heads, head_size=target.shape.head_dim)
    pages.layers = dict.fromkeys(pages.fields, like)  # type: ignore[arg-type]
    return pages


def _warm_on_meta(tli: int, pages_hook: Any = None) -> None:
    target = HFTarget(make_hf_model(num_layers=2))
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    drafter = MoADrafter(make_config(info, preset="small", tli=tli)).eval().to("meta")
    pages = _pages(drafter, target)
    if pages_hook is not None:
        pages_hook(pages)
    with OneDevice():
        warm_up(
            drafter, target.shape, pages, "FLASH_ATTN", torch.device("meta"), torch.float32,
            16, 4, paged_draft_step, page_rows,
        )  # fmt: skip


@pytest.mark.parametrize("tli", [0, 1])
def test_warm_up_makes_every_tensor_on_the_proposers_device(tli):
    _warm_on_meta(tli)


def test_stand_ins_are_the_serving_store_class_made_outside_inference_mode():
    target = HFTarget(make_hf_model(num_layers=2))
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    drafter = MoADrafter(make_config(info, preset="small")).eval()
    with torch.inference_mode():
        store = _pages(drafter, target).stand_in("sa", torch.float32, "FLASH_ATTN", 8, 16, "cpu")
    assert isinstance(store, TorchPagedKV)  # the GPU layouts' store (Triton's on CUDA)
    assert not store.key.is_inference()  # vLLM's caches are not inference tensors either


def test_control_host_stand_ins_are_caught():
    """The old warm-up: stand-in pages allocated on the host whatever the device."""

    def on_the_host(pages: DrafterPages) -> None:
        real = DrafterPages.stand_in

        def stand_in(self, name, dtype, backend, blocks, block_size, device):  # type: ignore[no-untyped-def]
            return real(self, name, dtype, backend, blocks, block_size, "cpu")

        pages.stand_in = stand_in.__get__(pages)  # type: ignore[method-assign]

    with pytest.raises(AssertionError, match="mixes devices"):
        _warm_on_meta(0, on_the_host)
