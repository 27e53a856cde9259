"""The vLLM proposer's compiled draft step and page rows (vllm_plugin/compiled.py): the same
results as eager on vLLM's CPU paged ops, and one set of graphs for every batch size and block
table width once warmed up (a recompile per shape would stall serving)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.model.config import TargetShape
from vllm_moa.vllm_plugin.compiled import Compiled, compile_wanted
from vllm_moa.vllm_plugin.drafting import page_rows, paged_draft_step, widen
from vllm_moa.vllm_plugin.paged_attention import CpuPagedKV, bind_stores

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

BLOCKS, BLOCK_SIZE = 24, 16


def _drafter() -> tuple[MoADrafter, nn.Embedding, TargetShape]:
    shape = TargetShape(3, 128, 1, 64, 256)
    drafter = MoADrafter(make_config(TargetInfo(shape, num_attention_heads=2), preset="small"))
    drafter.init_weights(seed=0)
    embed = nn.Embedding(256, 128)
    nn.init.normal_(embed.weight, generator=torch.Generator().manual_seed(1))
    return drafter.eval(), embed, shape


def _stores(drafter: MoADrafter, seed: int, inference: bool = True) -> dict[str, CpuPagedKV]:
    """SA and memory stores over page layers shaped like the target's (1 KV head of 64),
    filled with random rows; `inference=False`: caches made outside inference mode, as vLLM
    binds its caches (the proposer's stand-ins are made inside it)."""
    gen = torch.Generator().manual_seed(seed)
    stores = {}
    for name, attn in (
        ("sa", drafter.self_attention.self_attn),
        ("memory", drafter.cross_attention.self_attn),
    ):
        with torch.inference_mode(inference):
            cache = torch.zeros(BLOCKS, 1, BLOCK_SIZE, 128)
        store = CpuPagedKV.for_pages(cache, attn.num_kv_heads, attn.head_dim, torch.float32, name)
        slots = torch.arange(BLOCK_SIZE, BLOCKS * BLOCK_SIZE)
        k = torch.randn(slots.numel(), attn.num_kv_heads, attn.head_dim, generator=gen)
        store.write(k, torch.randn(k.shape, generator=gen), slots)
        stores[name] = store
    return stores


def _clone(stores: dict[str, CpuPagedKV]) -> dict[str, CpuPagedKV]:
    return {n: CpuPagedKV(s.key.clone(), s.value.clone(), s.isa, n) for n, s in stores.items()}


def _inputs(rows: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    table = (1 + torch.randperm(BLOCKS - 1, generator=gen)[: rows * width]).view(rows, width)
    positions = torch.randint(1, width * BLOCK_SIZE - 4, (rows,), generator=gen)
    ends = positions + torch.randint(0, 4, (rows,), generator=gen)  # some budgets end here
    return (
        table.to(torch.int32),
        torch.randint(0, 256, (rows,), generator=gen),
        positions,
        ends,
        positions.to(torch.int32).clamp(min=1),
        (positions > 2).long()[:, None, None],
    )


def test_compile_follows_vllms_mode(monkeypatch):
    from types import SimpleNamespace

    def config(eager: bool, mode: int) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=eager),
            compilation_config=SimpleNamespace(mode=mode),
        )

    monkeypatch.delenv("VLLM_MOA_COMPILE", raising=False)
    assert compile_wanted(config(False, 3))
    assert not compile_wanted(config(True, 0))
    assert not compile_wanted(config(False, 0))
    monkeypatch.setenv("VLLM_MOA_COMPILE", "1")
    assert compile_wanted(config(True, 0))
    monkeypatch.setenv("VLLM_MOA_COMPILE", "0")
    assert not compile_wanted(config(False, 3))
    monkeypatch.setenv("VLLM_MOA_COMPILE", "maybe")
    with pytest.raises(ValueError, match="VLLM_MOA_COMPILE='maybe': use auto, 1 or 0"):
        compile_wanted(config(False, 3))


@torch.inference_mode()
def test_compiled_step_equals_eager_at_every_batch_size_without_recompiling():
    drafter, embed, _ = _drafter()
    torch._dynamo.reset()
    step = Compiled(paged_draft_step)
    for rows in (3, 1):  # as the proposer warms it up
        table, tokens, *rest = _inputs(rows, 2, 0)
        stand_in = _stores(drafter, 0)
        bind_stores(stand_in)
        step.warm(drafter, stand_in, table, BLOCK_SIZE, embed(tokens), *rest)
    for rows, width in [(1, 1), (2, 2), (5, 3), (8, 1), (4, 4)]:
        stores = _stores(drafter, rows, inference=False)
        eager_stores = _clone(stores)
        table, tokens, positions, ends, memory_lens, has_memory = _inputs(rows, width, rows)
        want = paged_draft_step(
            drafter, eager_stores, table, BLOCK_SIZE, embed(tokens), positions, ends,
            memory_lens, has_memory,
        )  # fmt: skip
        bind_stores(stores)  # as the proposer does before its compiled step
        with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile fails the test
            got = step(
                drafter, stores, widen(table, 2), BLOCK_SIZE, embed(tokens), positions, ends,
                memory_lens, has_memory,
            )  # fmt: skip
        # fp32 both ways; Inductor reorders the norms' and SwiGLU's arithmetic.
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for name in stores:  # the same rows written
            torch.testing.assert_close(stores[name].key, eager_stores[name].key)
            torch.testing.assert_close(stores[name].value, eager_stores[name].value)


@torch.inference_mode()
def test_the_step_compiles_as_one_graph_over_vllms_cpu_ops():
    """vLLM's CPU attention ops run inside the project's custom ops (with fake kernels), so the
    whole draft step is one graph: fullgraph=True fails on any graph break. Its SA write
    lands before its attention reads (the token orders them), as in the eager step."""
    drafter, embed, _ = _drafter()
    stores = _stores(drafter, 2)
    eager_stores = _clone(stores)
    table, tokens, positions, ends, memory_lens, has_memory = _inputs(3, 2, 2)
    torch._dynamo.reset()
    step = torch.compile(paged_draft_step, fullgraph=True, dynamic=True)
    bind_stores(stores)
    got = step(
        drafter, stores, table, BLOCK_SIZE, embed(tokens), positions, ends, memory_lens,
        has_memory,
    )  # fmt: skip
    want = paged_draft_step(
        drafter, eager_stores, table, BLOCK_SIZE, embed(tokens), positions, ends, memory_lens,
        has_memory,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stores["sa"].key, eager_stores["sa"].key)


@torch.inference_mode()
def test_compiled_page_rows_equal_eager_without_recompiling():
    drafter, _, shape = _drafter()
    gen = torch.Generator().manual_seed(0)

    def rows_of(n: int) -> tuple[torch.Tensor, ...]:
        return (
            torch.randn(n, shape.hidden_size, generator=gen),
            torch.randn(
                n, shape.num_layers, 2 * shape.num_kv_heads * shape.head_dim, generator=gen
            ),
            torch.randint(0, 400, (n,), generator=gen),
        )

    torch._dynamo.reset()
    compiled = Compiled(page_rows)
    compiled.warm(drafter, *rows_of(3))
    compiled.warm(drafter, *rows_of(1))
    for n in (1, 2, 7, 40):
        inputs = rows_of(n)
        want = page_rows(drafter, *inputs)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = compiled(drafter, *inputs)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
