"""MoA's draft vocabulary in vLLM (docs/training.md, "MoA's draft vocabulary"): a drafter whose
drafts are restricted to part of the vocabulary drafts, in vLLM, the chains the standalone
engine drafts at the same contexts (every one a vocabulary token), and greedy outputs equal plain
decoding; with the LM head's rows of the vocabulary gathered at load (TP 1, unquantized head)
and without them (the argmax of the full logits over the draft columns, vllm_plugin/
draft_vocab.py). Control: the unrestricted drafter's chains differ at some of those contexts,
so the restriction is what vLLM drafted with. On V1 in-process, and on V2 through the CPU
harness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm_integration.chains import (
    assert_chains_are_the_standalone_proposers,
    differing_chains,
    encode,
    moa,
    plain_greedy,
    traced_lines,
)
from tests.vllm_integration.conftest import check_drafts_equal_standalone
from tests.vllm_integration.test_vllm_offline import PROMPTS
from tests.vllm_integration.test_vllm_v2 import run_v2

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

K, MAX_TOKENS = 4, 32
DRAFT_VOCAB = 96  # of the test target's 512 tokens


def reduced_copy(target: Path, drafter_dir: Path, out: Path) -> tuple[Path, set[int]]:
    """`drafter_dir`'s drafter with a draft vocabulary: the 96 tokens the prompts and their plain
    greedy continuations use most (the target's next tokens mostly inside, so drafts land),
    saved to `out` with its training record; and the vocabulary."""
    from vllm_moa.checkpoint import load_drafter, save_drafter
    from vllm_moa.drafters.draft_vocab import frequent_tokens
    from vllm_moa.drafters.moa.model import MoADrafter

    drafter = load_drafter(drafter_dir)
    assert isinstance(drafter, MoADrafter)
    prompts = encode(target, PROMPTS[:6])
    continuations = plain_greedy(target, prompts, MAX_TOKENS)
    seqs = [p + c for p, c in zip(prompts, continuations, strict=True)]
    vocab = frequent_tokens(seqs, drafter.config.vocab_size, DRAFT_VOCAB).token_ids
    drafter.set_draft_vocab_size(DRAFT_VOCAB)
    drafter.set_draft_vocab(vocab)
    training = json.loads((drafter_dir / "config.json").read_text()).get("training")
    return Path(save_drafter(drafter, out, training=training)), set(vocab.tolist())


@pytest.mark.parametrize("tli", [0, 1])
@pytest.mark.parametrize("gathered", [True, False])
def test_reduced_vocabulary_drafts_as_the_standalone_engine(
    moa_pair, tmp_path, monkeypatch, tli, gathered
):
    """V1: outputs equal the standalone engine's (plain decoding's), every chain is its chain at
    the same context and lies in the vocabulary; the LM-head rows gathered (this target's head
    allows it) or, forced, the full logits' draft columns. Control: the unrestricted drafter
    drafts other chains at some traced contexts."""
    import vllm_moa.vllm_plugin.loading as loading
    from vllm_moa.vllm_plugin.target_view import VllmTargetView

    target, full = moa_pair["target"], moa_pair[f"tli{tli}"]
    drafter, vocab = reduced_copy(target, full, tmp_path / "reduced")
    heads = []
    real = loading.draft_vocab_head

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        heads.append(real(*args, **kwargs))
        return heads[-1]

    monkeypatch.setattr(loading, "draft_vocab_head", spy)
    if not gathered:
        monkeypatch.setattr(VllmTargetView, "lm_head_rows", lambda self, ids: None)
    check_drafts_equal_standalone(
        target, drafter, PROMPTS[:6], tmp_path, monkeypatch, K, MAX_TOKENS
    )
    assert [h.gathered for h in heads] == [gathered]
    trace = tmp_path / "trace.jsonl"
    lines = traced_lines(trace)
    assert len(lines) >= 6 * 4
    assert all(set(chain) <= vocab for _, chain in lines)
    unrestricted, _ = differing_chains(target, full, trace, K)
    print(f"TLI={tli}: {len(unrestricted)} of {len(lines)} chains differ from the unrestricted")
    assert unrestricted, "control: the unrestricted drafter drafts the same chains"


def test_reduced_vocabulary_on_v2(moa_pair, tmp_path):
    """V2 (TLI 0; its draft loop is the one V2 captures in CUDA graphs on a GPU): outputs equal
    plain V2 decoding and every chain is the standalone proposer's, inside the vocabulary."""
    target = moa_pair["target"]
    drafter, vocab = reduced_copy(target, moa_pair["tli0"], tmp_path / "reduced")
    prompts = encode(target, PROMPTS[:6])
    trace = tmp_path / "v2.jsonl"
    (plain, got), log = run_v2(target, prompts, [{}, {"spec": moa(drafter), "trace": str(trace)}])
    assert "MoA runs on vLLM's V2 model runner" in log
    assert "MoA draft vocabulary: 96 of 512 tokens, drafted from their LM-head rows" in log
    assert got["passes"] == plain["passes"]
    assert_chains_are_the_standalone_proposers(target, drafter, trace, K, 6 * 4)
    assert all(set(chain) <= vocab for _, chain in traced_lines(trace))
