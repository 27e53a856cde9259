"""MoA on vLLM's V2 model runner (the GPU default), run on this CPU through the test harness
(v2_on_cpu.py: Triton's interpreter stands in for a Triton CPU backend, so V2's own kernels run,
slowly). Every run is a fresh interpreter with the harness installed at start-up, so vLLM picks
V2 by itself and the log says so.

The strong check throughout: every chain MoA drafts on V2 equals the standalone proposer's at
the same context (vLLM's verifier makes the output equal plain decoding whatever is drafted, so
output equality alone proves nothing about the drafter); outputs equal plain decoding on V2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.costs import costs_setup
from tests.vllm_integration import v2_on_cpu
from tests.vllm_integration.chains import (
    ENGINES,
    assert_chains_are_the_standalone_proposers,
    encode,
    moa,
    plain_greedy,
    traced_chains,
)
from tests.vllm_integration.conftest import run_script
from tests.vllm_integration.test_vllm_offline import PROMPTS
from vllm_moa.vllm_plugin import patches

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step


def run_v2(target: Path, prompts: list[list[int]], runs: list[dict]) -> tuple[list[dict], str]:
    """Engines one after another on V2, in one interpreter (chains.py's `ENGINES`)."""
    env = v2_on_cpu.env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    job = {"target": str(target), "prompts": prompts, "runs": runs}
    return run_script(ENGINES, json.dumps(job), env=env)


def test_moa_on_v2_equals_plain_and_drafts_as_the_standalone_engine(moa_pair, tmp_path):
    """TLI 0 and 1 on V2: greedy outputs equal plain V2 decoding; every drafted chain equals the
    standalone proposer's at its context; drafts are made and accepted; the runner is V2."""
    prompts = encode(moa_pair["target"], PROMPTS[:6])
    runs = [{}] + [
        {"spec": moa(moa_pair[f"tli{t}"]), "trace": str(tmp_path / f"tli{t}.jsonl")} for t in (0, 1)
    ]
    (plain, *drafted), log = run_v2(moa_pair["target"], prompts, runs)
    assert "Using V2 Model Runner" in log
    assert "MoA runs on vLLM's V2 model runner" in log
    for tli, got in enumerate(drafted):
        assert got["passes"] == plain["passes"], f"TLI={tli}"
        metrics = got["metrics"]
        assert metrics["vllm:spec_decode_num_draft_tokens"] >= 4 * 6 * 4, f"TLI={tli}"
        assert metrics["vllm:spec_decode_num_accepted_tokens"] >= 5, f"TLI={tli}"
        assert_chains_are_the_standalone_proposers(
            moa_pair["target"], moa_pair[f"tli{tli}"], tmp_path / f"tli{tli}.jsonl", 4, 6 * 4
        )


def test_v2_preemption_chunked_prefill_and_prefix_caching(moa_pair, tmp_path):
    """The page rows need no per-request bookkeeping on V2. Long prompts prefilled in chunks in
    a cache too small for all requests (preemption, recomputed later); then, in a roomy cache,
    the same prompts served twice (the second pass hits the prefix cache, whose blocks carry the
    page rows: those positions are not computed again). Outputs equal plain decoding and every
    chain equals the standalone proposer's."""
    prompts = encode(moa_pair["target"], [p * 4 for p in PROMPTS[:6]])
    small = {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 10, "max_model_len": 256,
             "block_size": 32}  # fmt: skip
    cached = {"enable_prefix_caching": True, "block_size": 32, "max_model_len": 256}
    params = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    runs = [
        {"kwargs": small, "params": params},
        {"spec": moa(moa_pair["tli1"]), "trace": str(tmp_path / "small.jsonl"), "kwargs": small,
         "params": params},
        {"spec": moa(moa_pair["tli1"]), "trace": str(tmp_path / "cached.jsonl"),
         "kwargs": cached, "params": params, "repeat": 2},
    ]  # fmt: skip
    (plain, preempted, hit), _ = run_v2(moa_pair["target"], prompts, runs)
    assert preempted["passes"] == plain["passes"]
    assert hit["passes"] == plain["passes"] * 2
    assert preempted["metrics"]["vllm:num_preemptions"] > 0, "the setup should force preemption"
    assert hit["metrics"]["vllm:prefix_cache_hits"] > 0, "the second pass should hit the cache"
    for name, got in (("small", preempted), ("cached", hit)):
        assert got["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
        assert_chains_are_the_standalone_proposers(
            moa_pair["target"], moa_pair["tli1"], tmp_path / f"{name}.jsonl", 4, 6 * 3
        )


def test_v2_control_wrong_rows_are_caught(moa_pair, sharp_drafter, tmp_path, monkeypatch):
    """Control: the V2 check above fails when the drafter reads the wrong rows (each step's page
    rows written one position late), so it is not vacuous (with a drafter whose chains depend on
    every row it reads: `sharp_drafter`)."""
    prompts = encode(moa_pair["target"], PROMPTS[:4])
    trace = tmp_path / "trace.jsonl"
    runs = [{"spec": moa(sharp_drafter), "trace": str(trace)}]
    env = v2_on_cpu.env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    job = {"target": str(moa_pair["target"]), "prompts": prompts, "runs": runs}
    broken = (
        "import vllm_moa.vllm_plugin.speculator as s\n"
        "from dataclasses import replace\n"
        "real = s.step_views\n"
        "def shifted(*a, **k):\n"
        "    rows, inputs = real(*a, **k)\n"
        "    return replace(rows, positions=rows.positions + 1), inputs\n"
        "s.step_views = shifted\n"
    )
    run_script(broken + ENGINES, json.dumps(job), env=env)
    with pytest.raises(AssertionError, match="differ from the standalone proposer"):
        assert_chains_are_the_standalone_proposers(
            moa_pair["target"], sharp_drafter, trace, 4, 4 * 4
        )


def test_v2_sampling_repeats_with_a_seed(moa_pair):
    """T > 0 on V2: a seeded request's text repeats run to run (drafts
    are greedy and the lengths fixed, so vLLM's draws follow the seed). (top-k / top-p cannot
    run here: vLLM's own top-k/top-p Triton kernel fails under the interpreter, with or without
    speculation.)"""
    prompts = encode(moa_pair["target"], PROMPTS[:3])
    params = {"temperature": 0.8, "seed": 7, "max_tokens": 24, "ignore_eos": True}
    run = {"spec": moa(moa_pair["tli1"]), "params": params, "repeat": 2}
    (got,), _ = run_v2(moa_pair["target"], prompts, [run])
    assert got["passes"][0] == got["passes"][1]
    assert got["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_async_scheduling_stays_on_with_moa_on_v2(moa_pair, monkeypatch):
    """vLLM keeps async scheduling on for MoA on V2, as for its EAGLE, and turns it off on V1
    (MoA's V1 proposer returns host lists). vllm-cpu switches async scheduling off on every CPU
    after the decision (platforms/cpu.py): that override is bypassed here to see vLLM's own
    decision. (Async on with MoA is a GPU-only path: docs/vllm_v2.md.)"""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    original = type(current_platform).check_and_update_config

    def keep_async(cls, config):  # the CPU platform's update, without its async override
        decided = config.scheduler_config.async_scheduling
        original.__func__(cls, config)
        config.scheduler_config.async_scheduling = decided

    monkeypatch.setattr(type(current_platform), "check_and_update_config", classmethod(keep_async))
    monkeypatch.setattr("vllm.config.vllm.HAS_TRITON", True)  # as on a GPU: vLLM picks V2
    spec = moa(moa_pair["tli0"], 3)
    decided = {}
    for runner in ("1", "0"):  # vLLM's own choice (V2), and V1 asked for
        if runner == "1":
            monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
        else:
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
        config = EngineArgs(
            model=str(moa_pair["target"]), dtype="float32", enforce_eager=True,
            max_model_len=256, speculative_config=spec,
        ).create_engine_config()  # fmt: skip
        decided[runner] = (config.use_v2_model_runner, config.scheduler_config.async_scheduling)
    assert decided == {"1": (True, True), "0": (False, False)}
    # Control: without the patch's extension vLLM 0.32 turns it off for MoA on V2 too (0.33
    # keeps async scheduling on for every method on V2, so there the patch changes nothing).
    from contextlib import nullcontext

    monkeypatch.setattr(patches, "async_scheduling_allowed_for_moa", nullcontext)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = EngineArgs(
        model=str(moa_pair["target"]), dtype="float32", enforce_eager=True,
        max_model_len=256, speculative_config=spec,
    ).create_engine_config()  # fmt: skip
    assert config.use_v2_model_runner and config.scheduler_config.async_scheduling is False


def test_moa_on_v2_with_async_scheduling_drafts_as_the_standalone_engine(moa_pair, tmp_path):
    """Async scheduling, which vLLM keeps on for MoA on V2 (previous test), run: the engine
    schedules a step before the last one's output is back and the speculator sees only device
    verdicts. vllm-cpu forces it off; with that override bypassed the engine core runs its batch
    queue (asserted), and MoA's output equals plain greedy decoding and every chain drafted
    equals the standalone proposer's, TLI 0 at a fixed K and TLI 1 adaptive (the verdicts'
    copies folded steps later)."""
    prompts = encode(moa_pair["target"], PROMPTS[:6])
    runs = [
        {"spec": moa(moa_pair["tli0"]), "trace": str(tmp_path / "tli0.jsonl"),
         "kwargs": {"async_scheduling": True}, "setup": v2_on_cpu.ASYNC_ON},
        {"spec": moa(moa_pair["tli1"]), "trace": str(tmp_path / "tli1.jsonl"),
         "kwargs": {"async_scheduling": True}, "setup": v2_on_cpu.ASYNC_ON,
         "env": {"VLLM_MOA_ADAPTIVE": "1"}},
    ]  # fmt: skip
    results, log = run_v2(moa_pair["target"], prompts, runs)
    assert log.count("MOA_TEST batch queue True") == 2, "async scheduling did not run"
    assert "adaptive: draft steps chosen per step" in log
    plain = plain_greedy(moa_pair["target"], prompts, 32)
    for tli, got in enumerate(results):
        assert got["passes"] == [plain], f"TLI={tli}"
        assert got["metrics"]["vllm:spec_decode_num_draft_tokens"] >= 4 * 6 * 4, f"TLI={tli}"
        assert got["metrics"]["vllm:spec_decode_num_accepted_tokens"] >= 5, f"TLI={tli}"
        assert_chains_are_the_standalone_proposers(
            moa_pair["target"], moa_pair[f"tli{tli}"], tmp_path / f"tli{tli}.jsonl", 4, 6 * 4
        )


def test_v2_sampled_distribution_equals_plain_and_the_control_fails(moa_pair):
    """T > 0 through V2's own rejection sampler: per generated position, a chi-square test of
    MoA's token counts against plain sampling (all tables summed into one test, as in
    test_vllm_sampling.py), every request seeded so the test cannot flake. Control: vLLM's own
    lossy 'synthetic' verifier (it accepts drafts at a set rate, whatever the target's
    probabilities) must fail the same test. Two temperatures in one batch, 80 requests each
    (150 gave the control p = 1e-275 and MoA p = 0.71: half the sample keeps the control far
    below its bar; the power analysis of lossless sampling is test_vllm_sampling_power.py's, on
    V1). Top-k / top-p cannot run under the interpreter: see the seed test."""
    from tests.vllm_integration.test_vllm_sampling import MAX_TOKENS, PROMPT, _p_value

    n, groups = 80, ({"temperature": 1.0}, {"temperature": 0.7})
    prompts = encode(moa_pair["target"], [PROMPT])
    synthetic = {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.0}
    arms = {
        "plain": None,
        "moa": moa(moa_pair["tli0"]),
        "control": moa(moa_pair["tli0"], **synthetic),
    }
    job = {"target": str(moa_pair["target"]), "prompt": prompts[0], "n": n,
           "groups": list(groups), "max_tokens": MAX_TOKENS, "arms": arms}  # fmt: skip
    script = """
import gc, json, sys
from vllm import LLM, SamplingParams
job = json.loads(sys.argv[1])
out = {}
for name, spec in job["arms"].items():
    llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, max_model_len=256,
              seed=0, speculative_config=spec, disable_log_stats=False)
    base = 0 if name == "plain" else 100_000
    params = [SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True,
                             seed=base + 1000 * g + i, **group)
              for g, group in enumerate(job["groups"]) for i in range(job["n"])]
    outs = llm.generate([{"prompt_token_ids": job["prompt"]}] * len(params), params,
                        use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    accepted = sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics()
                   if m.name == "vllm:spec_decode_num_accepted_tokens")
    out[name] = {"tokens": tokens, "accepted": accepted}
    del llm
    gc.collect()
print("RESULT " + json.dumps(out))
"""
    env = v2_on_cpu.env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    got, _ = run_script(script, json.dumps(job), env=env)

    def by_group(tokens: list[list[int]]) -> dict[int, list[list[int]]]:
        return {g: tokens[g * n : (g + 1) * n] for g in range(len(groups))}

    assert got["moa"]["accepted"] >= 60, "too few accepted drafts for the test to say anything"
    plain = by_group(got["plain"]["tokens"])
    p_moa = _p_value(plain, by_group(got["moa"]["tokens"]))
    p_control = _p_value(plain, by_group(got["control"]["tokens"]))
    print(f"p-values: MoA {p_moa:.3g}, synthetic-verifier control {p_control:.3g}")
    assert p_control < 1e-6, "control: a lossy verifier should fail this test"
    assert p_moa > 1e-3, f"MoA sampling on V2 differs from plain sampling (p={p_moa:.3g})"


def test_v2_tensor_parallel_with_sharded_kv_heads(sharded_pair, tmp_path):
    """TP=2 on V2 (two worker processes, each with the harness from start-up) over a target
    whose KV heads are sharded, in the default adaptive mode (rank 0's choice of draft steps on
    both ranks): outputs equal plain greedy decoding, and every chain either rank drafts equals
    the standalone proposer's (fp32, unsharded) at its context. Plain decoding is the standalone
    target's (fp32, unsharded), as in the V1 TP test (a plain TP=2 engine on V2 costs ~40 s)."""
    prompts = encode(sharded_pair["target"], PROMPTS[:4])
    script = """
import json, sys
from vllm import LLM, SamplingParams
job = json.loads(sys.argv[1])
llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
          tensor_parallel_size=2, speculative_config=job["spec"], disable_log_stats=False)
outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]],
                    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
    env = v2_on_cpu.env(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1",
                        VLLM_CPU_OMP_THREADS_BIND="0|1")  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    job = {"target": str(sharded_pair["target"]), "prompts": prompts,
           "spec": moa(sharded_pair["drafter"], 3)}  # fmt: skip
    adaptive = {"VLLM_MOA_TRACE": str(trace), "VLLM_MOA_ADAPTIVE": "1"}
    got, log = run_script(script, json.dumps(job), env={**env, **adaptive})
    assert "MoA runs on vLLM's V2 model runner (K=3, adaptive" in log
    assert got == plain_greedy(sharded_pair["target"], prompts, 16)
    assert_chains_are_the_standalone_proposers(
        sharded_pair["target"], sharded_pair["drafter"], trace, 3, 4 * 3
    )


def test_v2_honours_the_batch_size_schedule(moa_pair, tmp_path):
    """vLLM's dynamic speculation schedule (`num_speculative_tokens_per_batch_size`) on V2: the
    scheduler caps each step's drafts by batch size and the speculator drafts that many (4 for
    a lone request, 2 for 2..64): outputs equal plain, chains equal the standalone proposer's,
    and the batch of 4 drafted 2 tokens a step."""
    prompts = encode(moa_pair["target"], PROMPTS[:4])
    trace = tmp_path / "trace.jsonl"
    schedule = [[1, 1, 4], [2, 64, 2]]
    runs = [
        {},
        {"spec": moa(moa_pair["tli0"], num_speculative_tokens_per_batch_size=schedule),
         "trace": str(trace)},
    ]  # fmt: skip
    (plain, got), _ = run_v2(moa_pair["target"], prompts, runs)
    assert got["passes"] == plain["passes"]
    metrics = got["metrics"]
    drafts, tokens = (
        metrics["vllm:spec_decode_num_drafts"],
        metrics["vllm:spec_decode_num_draft_tokens"],
    )
    assert drafts > 0 and tokens == 2 * drafts, (drafts, tokens)
    # a request left alone drafts 4: the reference chains are 4 long
    assert_chains_are_the_standalone_proposers(
        moa_pair["target"], moa_pair["tli0"], trace, 4, 4 * 4
    )


# The V2 speculator's cost model with its measurements replaced: a draft step costs `draft`
# seconds against a target step of about 20 ms. Measured costs would not do: V2's target step is
# interpreted here (~200 ms) while a draft step is not (~1.3 ms), so drafting looks almost free
# and the rule rightly keeps drafting even a useless drafter's tokens.
def drafts_costing(draft: float) -> str:
    return costs_setup("vllm_moa.vllm_plugin.draft_steps", f"_fixed_costs({draft})")


CHEAP_DRAFTS = drafts_costing(0.0002)  # 1/100 of a target step
GPU_LIKE_DRAFTS = drafts_costing(0.004)  # 1/5: a small drafter against an 8B target


def test_v2_adaptive_speculation(moa_pair, random_drafter, tmp_path):
    """The default mode on V2 (adaptive: the batch's draft steps m chosen per step, padding past
    them): outputs equal plain decoding; with drafting made cheap the test pair's drafts land
    and every chain drafted equals the standalone proposer's (as far as it goes); a drafter that
    never matches mostly stops drafting where a draft step costs what it would on a GPU
    (control: the same engine at a fixed K drafts K every step). Costs are injected (see
    `drafts_costing`)."""
    prompts = encode(moa_pair["target"], PROMPTS[:6])
    params = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
    on = {"VLLM_MOA_ADAPTIVE": "1"}
    runs = [
        {"params": params},
        {"spec": moa(random_drafter), "trace": str(tmp_path / "useless.jsonl"), "env": on,
         "setup": GPU_LIKE_DRAFTS, "params": params},
        {"spec": moa(moa_pair["tli0"]), "trace": str(tmp_path / "cheap.jsonl"), "env": on,
         "setup": CHEAP_DRAFTS, "params": params},
    ]  # fmt: skip
    (plain, useless, cheap), log = run_v2(moa_pair["target"], prompts, runs)
    assert "adaptive: draft steps chosen per step" in log
    assert useless["passes"] == plain["passes"]
    assert cheap["passes"] == plain["passes"]
    request_steps = 6 * 48  # at most: one per generated token
    # At a fixed K every request-step drafts 4 tokens (<= 4 * 288); this target's repetitive
    # text lets even a random drafter land a few (alpha ~0.1-0.4 for some requests), so the rule
    # keeps a draft step where it pays and drops the rest.
    chains = [len(c) for c in traced_chains(tmp_path / "useless.jsonl").values()]
    assert sum(chains) < 0.3 * 4 * request_steps, f"{sum(chains)} tokens drafted of <= 1152"
    landed = traced_chains(tmp_path / "cheap.jsonl")
    assert len(landed) >= 6 * 20, f"only {len(landed)} request-steps drafted"
    assert cheap["metrics"]["vllm:spec_decode_num_accepted_tokens"] >= 10
    assert_chains_are_the_standalone_proposers(
        moa_pair["target"], moa_pair["tli0"], tmp_path / "cheap.jsonl", 4, 6 * 20
    )
    print(f"useless drafter: {sum(chains)} tokens drafted; cheap: {len(landed)} request-steps")
