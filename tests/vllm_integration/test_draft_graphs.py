"""The V2 speculator's CUDA graphs of the draft loop (vllm_plugin/draft_graphs.py), on the CPU
with an eager stand-in for the capture (each replay reruns the captured call on the buffers):
a replay gives the drafts `core.draft` gives, for every batch size below a captured one and
every number of draft steps; and the padded rows write nothing: after a larger batch, a smaller
one leaves the pages as drafting it alone does (control: padding left stale fails)."""

from __future__ import annotations

import pytest
import torch

from tests.vllm_integration.test_startup_devices import core_on
from vllm_moa.vllm_plugin.draft_graphs import DraftGraphs, eager_capture
from vllm_moa.vllm_plugin.drafting import DraftInputs

K = 3
BLOCKS = 4  # block-table width
NUM_BLOCKS = 41  # in the stores (block 0: vLLM's null block)


def batch(b: int, seed: int, steps: int = K) -> DraftInputs:
    """b requests at random positions, each in blocks of its own (of the stores' 1 + 40)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(1, 40, (b,), generator=g)
    tables = (torch.randperm(NUM_BLOCKS - 1, generator=g)[: b * BLOCKS] + 1).view(b, BLOCKS)
    return DraftInputs(
        tokens=torch.randint(0, 100, (b,), generator=g),
        positions=positions,
        ends=positions + steps,
        block_tables={0: tables.to(torch.int32)},
        max_seq_len=64,
        steps=steps,
    )


def graphs_of(core, sizes=(2, 4, 8)) -> DraftGraphs:  # type: ignore[no-untyped-def]
    graphs = DraftGraphs(core, list(sizes), K, {0: BLOCKS}, 64, torch.device("cpu"))
    graphs.capture(eager_capture)
    return graphs


def tensors(core) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    return [t for s in core.stores.values() for t in (s.key, s.value)]


def pages(core) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    return [t.clone() for t in tensors(core)]


def restore(core, saved: list[torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
    for t, s in zip(tensors(core), saved, strict=True):
        t.copy_(s)


def same_pages(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal but for block 0, vLLM's null block (padding slots write there; nobody reads it), up
    to float rounding: a padded batch's matrix products round differently (other blocking)."""
    return all(
        torch.allclose(x[1:], y[1:], rtol=1e-5, atol=1e-5) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("b, steps", [(1, K), (3, K), (3, 1), (8, 2)])
def test_a_replay_drafts_what_the_core_drafts(b, steps):
    core, _ = core_on(torch.device("cpu"), blocks=NUM_BLOCKS)
    graphs = graphs_of(core)
    inputs = batch(b, seed=b, steps=steps)
    before = pages(core)
    got = graphs.run(inputs)
    assert got is not None and got.shape == (b, steps)
    after_graph = pages(core)
    restore(core, before)
    with torch.inference_mode():  # as the speculator drafts
        want = core.draft(inputs)
    assert torch.equal(got, want)
    assert same_pages(after_graph, pages(core))  # the same slots written


def test_no_graph_for_a_batch_too_large_or_another_table():
    core, _ = core_on(torch.device("cpu"), blocks=NUM_BLOCKS)
    graphs = graphs_of(core)
    assert graphs.run(batch(9, seed=0)) is None
    wide = batch(2, seed=0)
    wide = DraftInputs(wide.tokens, wide.positions, wide.ends,
                       {0: torch.zeros(2, BLOCKS + 1, dtype=torch.int32)}, 64, K)  # fmt: skip
    assert graphs.run(wide) is None


def _smaller_after_larger(core, graphs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Pages after a batch of 4, then its last 2 requests finishing (their blocks freed and
    cleared, as if given to another request), then its first 2 drafting again: by graphs, and
    by the core."""
    start = pages(core)
    four = batch(4, seed=7)
    two = DraftInputs(four.tokens[:2], four.positions[:2] + 20, four.positions[:2] + 20 + K,
                      {0: four.block_tables[0][:2]}, 64, K)  # fmt: skip
    freed = four.block_tables[0][2:].flatten().long()

    def free() -> None:
        for t in tensors(core):
            t[freed] = 0.0

    graphs.run(four)
    free()
    graphs.run(two)
    by_graphs = pages(core)
    restore(core, start)
    with torch.inference_mode():
        core.draft(four)
        free()
        core.draft(two)
    return by_graphs, pages(core)


def test_padding_rows_write_nothing():
    core, _ = core_on(torch.device("cpu"), blocks=NUM_BLOCKS)
    by_graphs, by_core = _smaller_after_larger(core, graphs_of(core, sizes=(4, 8)))
    assert same_pages(by_graphs, by_core)


def test_control_stale_padding_writes_other_requests_rows(monkeypatch):
    core, _ = core_on(torch.device("cpu"), blocks=NUM_BLOCKS)
    graphs = graphs_of(core, sizes=(4, 8))  # the 2 requests replay the graph of 4
    monkeypatch.setattr(DraftGraphs, "_pad", lambda self, start: None)
    by_graphs, by_core = _smaller_after_larger(core, graphs)
    assert not same_pages(by_graphs, by_core)


@pytest.mark.parametrize("required", [False, True])
def test_a_loop_left_eager_is_visible_and_can_be_made_fatal(required, monkeypatch, caplog):
    """Where vLLM captures CUDA graphs and the draft loop stays eager (here: the drafter's pages
    cannot be laid over vLLM's caches, as a KV layout the reader does not know makes
    `core.ready()` raise), start-up goes on with a warning naming why, or stops with an error
    under VLLM_MOA_REQUIRE_GRAPHS=1 (benchmarks, a first GPU run)."""
    from types import SimpleNamespace

    from vllm_moa.vllm_plugin.speculator import REQUIRE_GRAPHS_ENV, MoASpeculator

    def unreadable() -> bool:
        raise ValueError("page_views: packed KV layout")

    stub = SimpleNamespace(core=SimpleNamespace(ready=unreadable), graphs=None)
    monkeypatch.setenv(REQUIRE_GRAPHS_ENV, "1" if required else "0")
    never = pytest.fail  # the capture is never reached
    if required:
        with pytest.raises(RuntimeError, match=r"not captured .*pages could not be laid") as e:
            MoASpeculator.capture_with(stub, never)  # type: ignore[arg-type]
        assert isinstance(e.value.__cause__, ValueError)
    else:
        with caplog.at_level("WARNING", logger="vllm.moa"):
            MoASpeculator.capture_with(stub, never)  # type: ignore[arg-type]
        assert "MoA draft loop not captured (the drafter's pages could not" in caplog.text
        assert f"{REQUIRE_GRAPHS_ENV}=1 makes this an error" in caplog.text
        assert stub.graphs is None


def test_draft_graphs_stay_within_vllms_capture_sizes():
    """The draft loop is captured at vLLM's capture sizes up to max_num_seqs and never beyond
    them (there vLLM runs the target eagerly and its attention metadata is not graph-safe)."""
    from types import SimpleNamespace

    from vllm_moa.vllm_plugin.speculator import draft_graph_sizes

    def config(sizes):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=sizes))

    assert draft_graph_sizes(config([1, 2, 4, 8, 16]), 12) == [1, 2, 4, 8]
    assert draft_graph_sizes(config([1, 2, 4]), 256) == [1, 2, 4]
    assert draft_graph_sizes(config(None), 8) == []
