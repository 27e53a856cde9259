"""MoA under tensor parallelism (vllm_plugin/tensor_parallel.py): TP=2 on vLLM's CPU backend
(two worker processes, one core each) gives plain decoding's greedy outputs at TP=1, with drafts
accepted and the two ranks drafting the same, for TLI 0 and 1 (whose tail runs the target's
sharded layers); and the K/V rows of every head are put together from the ranks' shares in both
of vLLM's head layouts."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.vllm_integration.conftest import run_script
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
target, drafter, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
spec = None if drafter == "-" else {"method": "moa", "model": drafter, "num_speculative_tokens": 3}
llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
          tensor_parallel_size=tp, speculative_config=spec, disable_log_stats=False)
outs = llm.generate(json.loads(sys.argv[4]), SamplingParams(temperature=0.0, max_tokens=32))
accepted = sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics()
               if m.name == "vllm:spec_decode_num_accepted_tokens")
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                              "accepted": accepted}))
"""


def _generate(target, drafter, tp: int, trace: Path | None = None) -> dict:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if trace is not None:
        env["VLLM_MOA_TRACE"] = str(trace)  # each rank's proposer appends its drafts
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(i % (os.cpu_count() or 1)) for i in range(tp)
        )
    result, _ = run_script(SCRIPT, target, drafter or "-", tp, json.dumps(PROMPTS[:6]), env=env)
    return result


def test_tp2_greedy_equals_plain_tp1(moa_pair, tmp_path):
    plain = _generate(moa_pair["target"], None, 1)
    for tli in (0, 1):
        trace = tmp_path / f"trace{tli}.jsonl"
        got = _generate(moa_pair["target"], moa_pair[f"tli{tli}"], 2, trace)
        assert got["tokens"] == plain["tokens"], f"TLI={tli}"
        assert got["accepted"] > 0, f"TLI={tli}: the trained drafter should land drafts"
        # Both ranks drafted, and drafted the same: every (context, drafts) line comes in pairs.
        lines = Counter(trace.read_text().splitlines())
        assert lines and all(n % 2 == 0 for n in lines.values()), f"TLI={tli}: ranks disagree"


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
