"""MoA under tensor parallelism (vllm_plugin/tensor_parallel.py) on vLLM's V1 runner: TP=2 on
vLLM's CPU backend (two worker processes, one core each), two engines in one interpreter:

- the test target, whose one KV head both ranks replicate, with the sensitive drafter (TLI=1:
  its tail runs the target's sharded layers), in the default adaptive mode with costs injected
  per rank: on rank 0 drafting pays, on rank 1 it never does, so rank 1 drafts only because
  every rank drafts rank 0's lengths (`same_on_every_rank`);
- a target whose 2 KV heads are sharded (one per rank) with a sharpened random TLI=1 drafter,
  at a fixed K.

Each: greedy outputs equal plain decoding, every chain either rank drafts equals the standalone
proposer's (fp32, unsharded) at its context, and both ranks draft the same chains; the adaptive
run drafts and lands a minimum of tokens. And the K/V rows of every head are put together from
the ranks' shares in both of vLLM's head layouts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.costs import costs_setup
from tests.vllm_integration.chains import (
    ENGINES,
    assert_chains_are_the_standalone_proposers,
    encode,
    moa,
    plain_greedy,
    worker_setup_env,
)
from tests.vllm_integration.conftest import run_script
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K, MAX_TOKENS = 3, 32


def per_rank_costs(choices: Path) -> str:
    """Setup source for every process vLLM starts (the workers are spawned): adaptive
    speculation's cost model, per rank, a draft step costing 1/100 of a target step on rank 0 and
    500 target steps on rank 1 (alone, rank 1 would draft nothing), the guard off (the injected
    model decides alone); and each call of `same_on_every_rank` appended to `choices` as [the
    rank's own lengths, the lengths it drafts]."""
    return costs_setup(
        "vllm_moa.vllm_plugin.proposer",
        "_costs_of_this_rank",
        defs=f"""
import json as _json

from vllm_moa.adaptive import DraftGuard as _DraftGuard


def _costs_of_this_rank(*args, **kwargs):
    from vllm.distributed import get_tensor_model_parallel_rank

    draft = 0.0002 if get_tensor_model_parallel_rank() == 0 else 10.0
    return _fixed_costs(draft)(*args, **kwargs)


def _recorded(values, _same=_proposer.same_on_every_rank):
    chosen = _same(values)
    with open({str(choices)!r}, "a") as f:
        f.write(_json.dumps([values, chosen]) + "\\n")
    return chosen


_proposer.DraftGuard = lambda: _DraftGuard(enabled=False)
_proposer.same_on_every_rank = _recorded
""",
    )


def test_tp2_drafts_are_the_standalone_proposers(
    moa_pair, sensitive_drafter, sharded_pair, tmp_path
):
    prompts = encode(moa_pair["target"], PROMPTS[:6])
    traces = {name: tmp_path / f"{name}.jsonl" for name in ("replicated", "sharded")}
    choices = tmp_path / "choices.jsonl"
    tp2 = {"tensor_parallel_size": 2, "max_model_len": 256}
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    runs = [
        {"target": str(moa_pair["target"]), "spec": moa(sensitive_drafter, K),
         "trace": str(traces["replicated"]), "kwargs": tp2, "params": params},
        {"target": str(sharded_pair["target"]),
         "spec": moa(sharded_pair["drafter"], K, moa_adaptive=False),
         "trace": str(traces["sharded"]), "kwargs": tp2, "params": params},
    ]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_MOA_ADAPTIVE": "1",  # the default, whatever the caller's shell says
        **worker_setup_env(per_rank_costs(choices)),
    }
    job = {"target": str(moa_pair["target"]), "prompts": prompts, "runs": runs}
    (adaptive, fixed), _ = run_script(ENGINES, json.dumps(job), env=env)
    assert adaptive["passes"] == [plain_greedy(moa_pair["target"], prompts, MAX_TOKENS)]
    assert fixed["passes"] == [plain_greedy(sharded_pair["target"], prompts, MAX_TOKENS)]
    metrics = adaptive["metrics"]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    assert drafted >= 100 and accepted >= 25, (drafted, accepted)
    # Rank 1 drafted because it followed rank 0: steps where its own choice was no drafts at all.
    followed = [json.loads(line) for line in choices.read_text().splitlines()]
    assert sum(not any(own) and any(chosen) for own, chosen in followed) >= 5, followed
    for name, drafter, target in (
        ("replicated", sensitive_drafter, moa_pair["target"]),
        ("sharded", sharded_pair["drafter"], sharded_pair["target"]),
    ):
        # Both ranks drafted, and drafted the same: every (context, drafts) line comes in pairs.
        lines = Counter(traces[name].read_text().splitlines())
        assert lines and all(n % 2 == 0 for n in lines.values()), f"{name}: ranks disagree"
        assert_chains_are_the_standalone_proposers(target, drafter, traces[name], K, 6 * 5)


@pytest.mark.parametrize("num_kv_heads, tp", [(4, 2), (2, 2), (1, 2), (2, 4)])
def test_kv_rows_of_every_head_from_the_ranks(monkeypatch, num_kv_heads, tp):
    """Rank r holds heads r * H / tp ... (H >= tp) or replicates head r * H // tp (H < tp), as
    vLLM's QKVParallelLinear shards them; the gathered rows equal the unsharded target's."""
    import vllm.distributed

    from vllm_moa.vllm_plugin.tensor_parallel import gather_kv_heads

    n, layers, d = 5, 3, 8
    full = torch.randn(n, layers, num_kv_heads, 2 * d)  # per head [k | v]
    per_rank = max(1, num_kv_heads // tp)
    shares = []
    for r in range(tp):
        first = r * num_kv_heads // tp if num_kv_heads < tp else r * per_rank
        shares.append(full[:, :, first : first + per_rank].flatten(2))
    rank = 1 % tp
    monkeypatch.setattr(
        vllm.distributed,
        "tensor_model_parallel_all_gather",
        lambda x, dim=-1: torch.cat(shares, dim),
    )
    got = gather_kv_heads(shares[rank], num_kv_heads, tp)
    assert torch.equal(got, full.flatten(2))
