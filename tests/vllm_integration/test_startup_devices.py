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
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.hf_target import HFTarget
from vllm_moa.vllm_plugin.drafting import page_rows, paged_draft_step, warm_up
from vllm_moa.vllm_plugin.paged_attention import TorchPagedKV
from vllm_moa.vllm_plugin.pages import DrafterPages

pytestmark = [pytest.mark.vllm, pytest.mark.fixed_k]  # K every step


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


def _core_on_meta(layers: int = 2) -> tuple[Any, dict[str, Any]]:
    """A drafting core (TLI=0) whose drafter, target view, caches and pages all sit on `meta`:
    the GPU layout's stores (TorchPagedKV), one KV-cache group."""
    return core_on(torch.device("meta"), layers)


def core_on(
    device: torch.device, layers: int = 2, blocks: int = 6, vocab: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """A drafting core (TLI=0) whose drafter, target view, caches and pages all sit on `device`
    (caches and pages random where they hold values): the GPU layout's stores (TorchPagedKV),
    one KV-cache group, `blocks` blocks of 16. `vocab`: a draft vocabulary (every third token)
    whose LM-head rows are "gathered", or whose drafts take the "whole" head's logits."""
    from vllm_moa.vllm_plugin.draft_vocab import draft_vocab_head
    from vllm_moa.vllm_plugin.drafting import CacheLayout, MoADraftCore
    from vllm_moa.vllm_plugin.paged_attention import page_views

    target = HFTarget(make_hf_model(num_layers=layers))
    shape = target.shape
    info = TargetInfo(shape, target.config.num_attention_heads)
    drafter = MoADrafter(make_config(info, preset="small"))
    drafter.init_weights(seed=3)
    if vocab is not None:  # set on the host: the ids are checked on load, which reads them
        drafter.set_draft_vocab_size(len(range(0, shape.vocab_size, 3)))
        drafter.set_draft_vocab(torch.arange(0, shape.vocab_size, 3))
    drafter = drafter.eval().to(device)
    pages = _pages(drafter, target)
    cache_shape = (blocks, shape.num_kv_heads, 16, 2 * shape.head_dim)
    backend = SimpleNamespace(get_name=lambda: "FLASH_ATTN")
    attns = [
        SimpleNamespace(kv_cache=_values(cache_shape, device), attn_backend=backend)
        for _ in range(layers)
    ]
    embed = torch.nn.Embedding(shape.vocab_size, shape.hidden_size, device=device)
    head = torch.nn.Linear(shape.hidden_size, shape.vocab_size, bias=False, device=device)

    def lm_head_rows(ids: torch.Tensor) -> torch.Tensor | None:
        return head.weight.detach()[ids] if vocab == "gathered" else None

    view = SimpleNamespace(
        shape=shape, attn_layers=attns, layer_names=[f"t{i}" for i in range(layers)],
        embed=embed, logits=head, lm_head_rows=lm_head_rows,
    )  # fmt: skip
    draft_head = None
    if vocab is not None:
        assert drafter.draft_ids is not None and drafter.draft_ids.device == device
        draft_head = draft_vocab_head(view, drafter.draft_ids, tp=1, cpu_gemm=False)  # type: ignore[arg-type]
    pages.layers = {name: SimpleNamespace(layer_name=f"p.{name}") for name in pages.fields}  # type: ignore[misc]
    core = object.__new__(MoADraftCore)
    core.__dict__.update(
        drafter=drafter, target=view, device=device, tp=1, vllm_config=None,
        target_dtype=torch.float32, backend="FLASH_ATTN", pages=pages, _cpu_layouts={},
        _group_cache=None, vocab=draft_head,
        _draft_step=paged_draft_step, _page_rows=page_rows,
        layout=CacheLayout({**dict.fromkeys(view.layer_names, (0, 16)),
                            **dict.fromkeys(["p.memory", "p.sa"], (0, 16))}, [[]]),
        stores={name: TorchPagedKV(*page_views(_values(cache_shape, device), *field))
                for name, field in pages.fields.items()},
    )  # fmt: skip
    return core, {"vocab": shape.vocab_size}


def _values(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A cache: random values where tensors hold values (not on `meta`)."""
    if device.type == "meta":
        return torch.empty(shape, device=device)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)


def _run_step_on_meta(core: Any, vocab: int) -> torch.Tensor:
    from vllm_moa.vllm_plugin.drafting import DraftInputs, PageRows

    meta = torch.device("meta")
    n, b = 7, 3
    rows = PageRows(
        token_ids=torch.empty(n, dtype=torch.long, device=meta),
        positions=torch.empty(n, dtype=torch.long, device=meta),
        slots={0: torch.empty(n, dtype=torch.long, device=meta)},
    )
    inputs = DraftInputs(
        tokens=torch.empty(b, dtype=torch.long, device=meta),
        positions=torch.empty(b, dtype=torch.long, device=meta),
        ends=torch.empty(b, dtype=torch.long, device=meta),
        block_tables={0: torch.empty(b, 4, dtype=torch.int32, device=meta)},
        max_seq_len=64,
        steps=4,
    )
    with torch.inference_mode(), OneDevice():  # as the speculator runs
        core.write_rows(rows)
        return core.draft(inputs)


def test_the_draft_path_never_reads_the_device_from_the_host():
    """The V2 speculator's device work (page rows, then K draft steps) runs on `meta` tensors,
    which hold no values: any `.item()`, `.tolist()`, `bool(tensor)` or data-dependent shape in
    that path would raise. So it has no host synchronisation and fixed shapes, what a CUDA graph
    needs to capture it (the V2 runner's speculators capture their draft loops)."""
    core, info = _core_on_meta()
    drafts = _run_step_on_meta(core, info["vocab"])
    assert drafts.shape == (3, 4) and drafts.device.type == "meta"


@pytest.mark.parametrize("vocab", ["gathered", "whole"])
def test_the_draft_vocabulary_path_never_reads_the_device_from_the_host(vocab):
    """The same with a draft vocabulary, its LM-head rows gathered or not: the drafts' mapping
    to token ids adds no host read and no data-dependent shape."""
    core, info = core_on(torch.device("meta"), vocab=vocab)
    assert core.vocab.gathered == (vocab == "gathered")
    drafts = _run_step_on_meta(core, info["vocab"])
    assert drafts.shape == (3, 4) and drafts.device.type == "meta"


def test_control_a_host_read_in_the_draft_path_is_caught(monkeypatch):
    import vllm_moa.vllm_plugin.drafting as drafting

    real = drafting.draft_slots

    def syncing(positions, ends, table, block_size):  # type: ignore[no-untyped-def]
        int(positions.max())  # a host read of a device value
        return real(positions, ends, table, block_size)

    monkeypatch.setattr(drafting, "draft_slots", syncing)
    core, info = _core_on_meta()
    with pytest.raises((RuntimeError, NotImplementedError)):
        _run_step_on_meta(core, info["vocab"])
