"""Controls of the drafts check (chains.py) on vLLM's V1 runner: the proposer made to feed LSA
the wrong target K/V rows must fail it, while greedy outputs stay plain decoding's (the verifier
keeps them so whatever is drafted: output equality cannot see these bugs). One in-process engine
with a sharpened random drafter (`sharp_drafter`: its chains depend on every row it reads), one
pass of 4 prompts per setting:

- right: every chain is the standalone proposer's (the check passes);
- one token off: each token's memory from the target's K/V at the position before it;
- layers reversed: LSA reads the target's layers in the opposite order;
- another request's rows: each token's memory from the K/V at its position in the next
  request of the batch.

The patch points are the V1 proposer's page-row writes (`MoAVllmProposer._write_pages`, which
knows each request's blocks) and the target rows they gather (`MoADraftCore.read_layer_kv`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.vllm_integration.chains import (
    assert_chains_are_the_standalone_proposers,
    differing_chains,
    plain_greedy,
)
from tests.vllm_integration.conftest import greedy, make_llm
from tests.vllm_integration.test_vllm_offline import PROMPTS
from vllm_moa.vllm_plugin.drafting import MoADraftCore
from vllm_moa.vllm_plugin.proposer import MoAVllmProposer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

K, MAX_TOKENS = 4, 32

# (request i, position p, requests n) -> the (request, position) whose target rows LSA reads.
Where = Callable[[int, int, int], tuple[int, int]]


def misread(monkeypatch: pytest.MonkeyPatch, where: Where) -> None:
    """LSA reads, for the token at position p of the i-th request of a step's page-row write,
    the target's K/V rows at `where(i, p, n)` (a position past the other request's blocks: its
    last slot)."""
    real_write, real_read = MoAVllmProposer._write_pages, MoADraftCore.read_layer_kv
    step: dict[str, list] = {}

    def write_pages(self, core, runner, states, pending):  # type: ignore[no-untyped-def]
        step["blocks"] = [s.block_ids for s in states]
        return real_write(self, core, runner, states, pending)

    def read_layer_kv(self: MoADraftCore, slots: dict[int, torch.Tensor]) -> torch.Tensor:
        tables, sizes = step["blocks"], dict(self.groups)
        moved = {}
        for group, rows in slots.items():
            size = sizes[group]
            owner = {b: (i, j) for i, ids in enumerate(tables) for j, b in enumerate(ids[group])}
            out = []
            for slot in rows.tolist():
                i, j = owner[slot // size]
                other, p = where(i, j * size + slot % size, len(tables))
                blocks = tables[other][group]
                p = min(p, len(blocks) * size - 1)
                out.append(blocks[p // size] * size + p % size)
            moved[group] = torch.tensor(out, dtype=rows.dtype, device=rows.device)
        return real_read(self, moved)

    monkeypatch.setattr(MoAVllmProposer, "_write_pages", write_pages)
    monkeypatch.setattr(MoADraftCore, "read_layer_kv", read_layer_kv)


def one_token_off(monkeypatch: pytest.MonkeyPatch) -> None:
    misread(monkeypatch, lambda i, p, n: (i, max(p - 1, 0)))


def another_requests_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    misread(monkeypatch, lambda i, p, n: ((i + 1) % n, p))


def layers_reversed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = MoADraftCore.read_layer_kv
    monkeypatch.setattr(
        MoADraftCore, "read_layer_kv", lambda self, slots: real(self, slots).flip(1)
    )


CONTROLS = {
    "one token off": one_token_off,
    "layers reversed": layers_reversed,
    "another request's rows": another_requests_rows,
}


def test_wrong_rows_fail_the_drafts_check_and_only_it(
    moa_pair, sharp_drafter, tmp_path, monkeypatch
):
    target = moa_pair["target"]
    llm = make_llm(target, sharp_drafter, k=K, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": llm.get_tokenizer().encode(p)} for p in PROMPTS[:4]]
    plain = plain_greedy(target, [p["prompt_token_ids"] for p in prompts], MAX_TOKENS)

    def run(name: str, patch: Callable[[pytest.MonkeyPatch], None] | None):
        trace = tmp_path / f"{name}.jsonl"
        with monkeypatch.context() as mp:
            mp.setenv("VLLM_MOA_TRACE", str(trace))
            if patch is not None:
                patch(mp)
            outs = llm.generate(prompts, greedy(MAX_TOKENS))
        assert [list(o.outputs[0].token_ids) for o in outs] == plain, name
        return trace

    assert_chains_are_the_standalone_proposers(target, sharp_drafter, run("right", None), K,
                                               4 * 15)  # fmt: skip
    for name, patch in CONTROLS.items():
        wrong, lines = differing_chains(target, sharp_drafter, run(name, patch), K)
        print(f"{name}: {len(wrong)} of {lines} chains differ from the standalone proposer")
        assert len(wrong) >= 5, f"control {name!r}: the check should fail ({len(wrong)} differ)"
