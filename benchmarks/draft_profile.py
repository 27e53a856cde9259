"""Where a draft phase's time goes inside vLLM: MoA against vLLM's EAGLE / EAGLE-3, per step.

    python -m benchmarks.draft_profile --target DIR --drafter MOA_DIR \
        [--eagle EAGLE_DIR [EAGLE3_DIR]] --prompts HumanEval.jsonl.gz \
        [--out benchmarks/results/draft_profile/draft_profile.json]

One in-process engine per arm (plain; MoA compiled as served; MoA with its proposer eager, for
the split by block; each `--eagle` drafter served by vLLM's own `eagle` / `eagle3`), batch 1,
the fixed K (adaptive speculation off: every phase drafts K), greedy, `--max-tokens` new tokens
per prompt, the arms taking turns prompt by prompt (alternate order). On the CPU every op is
synchronous, so host timers around the functions a phase calls measure them:

- engine step: `LLMEngine.step` (schedule, target forward, sampling / verification, drafting);
- draft phase: the V1 runner's `propose_draft_token_ids`;
- MoA: page rows (`MoADraftCore.write_rows`: the target K/V of the tokens just verified read
  from the paged caches (`read_kv`), LSA and the SA / memory K/V projections (`rows_math`), the
  pages written), the draft steps (`MoADraftCore.draft`), and in them the drafter's step (SA +
  CA: one compiled graph), the target's LM head and embedding; with the proposer eager, also
  SA and CA apart (`step_glue`: the step's rest), and the paged attention calls (`attend`: SA's
  and CA's, `write`: SA's rows);
- EAGLE: vLLM's `EagleProposer.propose`, and in it the drafter's LM head (`compute_logits`).

"other" is the phase's time outside the timed parts (the adapter's bookkeeping, uploads,
argmax). Per arm: medians over decode steps (a request's first step, its prefill, is left out)
in ms, the target step (engine step minus the draft phase) and plain's step, and
c = (draft phase - page rows) / K / plain step: one draft step's cost in plain target steps.
Per request, prefill included: the prefill step's median (and MoA's page rows in it: the
prompt's rows), decode steps per request and the mean wall of a request, which is what
tokens/s sees.
Writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from vllm_moa.adaptive import ADAPTIVE_ENV
from vllm_moa.vllm_plugin.compiled import COMPILE_ENV

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

# Seconds spent in each timed function since the last `take()`.
SPENT: dict[str, float] = defaultdict(float)


def take() -> dict[str, float]:
    out = dict(SPENT)
    SPENT.clear()
    return out


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - began

    wrapper._timed = True  # type: ignore[attr-defined]
    return wrapper


def patch_class(cls: Any, attr: str, name: str, first: Callable[[Any], None] | None = None) -> None:
    """Time `cls.attr` as `name`; `first(self)` runs at an instance's first call (to put
    instance-level timers on it)."""
    inner = getattr(cls, attr)
    if getattr(inner, "_timed", False):
        return

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if first is not None and not getattr(self, "_profiled", False):
            self._profiled = True
            first(self)
        return inner(self, *args, **kwargs)

    setattr(cls, attr, timed(name, method))


def time_moa_core(core: Any) -> None:
    """Instance timers on a MoA core; with its proposer eager, on SA, CA and the pages too
    (under torch.compile they would be traced, so the compiled step is timed whole)."""
    from vllm_moa.vllm_plugin.compiled import Compiled

    compiled = isinstance(core._draft_step, Compiled)
    core._draft_step = timed("drafter_step", core._draft_step)
    core._page_rows = timed("rows_math", core._page_rows)
    core.read_layer_kv = timed("read_kv", core.read_layer_kv)
    core.target.logits = timed("lm_head", core.target.logits)
    core.target.embed = timed("embed", core.target.embed)
    if compiled:
        return
    drafter = core.drafter
    drafter.self_attention.step = timed("sa", drafter.self_attention.step)
    drafter.cross_attention.step = timed("ca", drafter.cross_attention.step)
    for store in core.stores.values():
        store.attend = timed("attend", store.attend)
        store.write = timed("write", store.write)


def time_eagle(proposer: Any) -> None:
    proposer.model.compute_logits = timed("lm_head", proposer.model.compute_logits)


def install_timers() -> None:
    """Class-level timers (every engine of the process); call after the engines exist (the
    plugin patches the runner when vLLM loads it)."""
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_moa.vllm_plugin.drafting import MoADraftCore

    patch_class(GPUModelRunner, "propose_draft_token_ids", "phase")
    patch_class(EagleProposer, "propose", "eagle_propose", time_eagle)
    patch_class(MoADraftCore, "write_rows", "rows")
    patch_class(MoADraftCore, "draft", "draft_steps", time_moa_core)


def run_prompt(engine: Any, prompt: str, params: Any, tag: str) -> list[dict[str, float]]:
    """One request to the end: per engine step, the timed parts (s) and `step` (its wall)."""
    engine.add_request(tag, prompt, params)
    take()
    steps = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - began
        steps.append({**take(), "step": wall})
    steps[0]["prefill"] = 1.0  # the first step is the prompt's prefill
    return steps


PARTS = {  # reported parts of a draft phase, per arm kind, in plot order
    "moa": ["read_kv", "rows_math", "rows_write", "drafter_step", "lm_head", "embed", "other"],
    "moa_eager": [
        "read_kv",
        "rows_math",
        "rows_write",
        "sa",
        "ca",
        "step_glue",
        "lm_head",
        "embed",
        "other",
    ],
    "eagle": ["eagle_layers", "lm_head", "other"],
}


def summarise(arm: str, steps: list[dict[str, float]], k: int) -> dict[str, Any]:
    """Medians (ms) over decode steps that drafted (all of plain's)."""

    def part(s: dict[str, float], name: str) -> float:
        if name == "rows_write":  # the page stores' writes of the rows
            return s.get("rows", 0) - s.get("read_kv", 0) - s.get("rows_math", 0)
        if name == "step_glue":  # the drafter's step outside SA and CA (slots, casts)
            return s.get("drafter_step", 0) - s.get("sa", 0) - s.get("ca", 0)
        if name == "eagle_layers":
            return s.get("eagle_propose", 0) - s.get("lm_head", 0)
        if name == "other":
            timed_parts = [p for p in PARTS[kind_of(arm)] if p != "other"]
            return s.get("phase", 0) - sum(part(s, p) for p in timed_parts)
        return s.get(name, 0)

    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    prefills = [s for s in steps if s.get("prefill")]
    whole = {  # per request: its steps and its wall, prefill included
        "prefill_step_ms": ms([s["step"] for s in prefills]),
        "steps_per_request": (len(steps) - len(prefills)) / len(prefills),
        "request_ms": 1e3 * sum(s["step"] for s in steps) / len(prefills),
    }
    if arm != "plain":
        whole["prefill_rows_ms"] = ms([s.get("rows", 0) for s in prefills])
    # decode steps; a speculative arm's only where it drafted
    steps = [s for s in steps if not s.get("prefill") and (arm == "plain" or s.get("phase", 0) > 0)]
    row: dict[str, Any] = {"arm": arm, "steps": len(steps)}
    row["engine_step_ms"] = ms([s["step"] for s in steps])
    if arm == "plain":
        return {**row, **whole}
    row["target_step_ms"] = ms([s["step"] - s["phase"] for s in steps])
    row["draft_phase_ms"] = ms([s["phase"] for s in steps])
    row["parts_ms"] = {name: ms([part(s, name) for s in steps]) for name in PARTS[kind_of(arm)]}
    if kind_of(arm).startswith("moa"):
        row["page_rows_ms"] = ms([s.get("rows", 0) for s in steps])
        row["draft_step_ms"] = ms([s.get("draft_steps", 0) / k for s in steps])
    else:
        row["draft_step_ms"] = row["draft_phase_ms"] / k
    if kind_of(arm) == "moa_eager":
        row["attention_ms"] = ms([s.get("attend", 0) + s.get("write", 0) for s in steps])
    return {**row, **whole}


def kind_of(arm: str) -> str:
    if arm.startswith("moa"):
        return "moa_eager" if arm.endswith("eager") else "moa"
    return "eagle"


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [r for r in rows if r["arm"] != "plain"]
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(dict.fromkeys(p for r in arms for p in r["parts_ms"]))
    bottoms = [0.0] * len(arms)
    for i, name in enumerate(names):
        heights = [max(0.0, r["parts_ms"].get(name, 0.0)) for r in arms]
        ax.bar([r["arm"] for r in arms], heights, bottom=bottoms, label=name, color=f"C{i}")
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    plain = next((r["engine_step_ms"] for r in rows if r["arm"] == "plain"), None)
    if plain is not None:
        ax.axhline(plain, color="k", ls="--", lw=1, label="plain target step")
    ax.set_ylabel("ms per draft phase (median)")
    ax.set_title("draft phase at batch 1, fixed K")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from benchmarks.testbed.evaluate import read_prompts
    from benchmarks.testbed.report import add_out_argument, save_json
    from benchmarks.throughput import make_engine, vllm_eagle_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="MoA drafter")
    p.add_argument("--eagle", nargs="*", default=[], help="EAGLE / EAGLE-3 drafters (ours)")
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    add_out_argument(p, "draft_profile")
    args = p.parse_args()

    import vllm
    from vllm import SamplingParams

    specs: dict[str, dict[str, Any] | None] = {"plain": None}
    moa = {"method": "moa", "model": args.drafter, "num_speculative_tokens": args.k}
    specs["moa"] = specs["moa_eager"] = moa
    for path in args.eagle:
        method, model = vllm_eagle_dir(path, args.target)
        specs[method] = {"method": method, "model": model, "num_speculative_tokens": args.k}
    engines = {}
    for arm, spec in specs.items():
        env = {ADAPTIVE_ENV: "0", **({COMPILE_ENV: "0"} if arm == "moa_eager" else {})}
        with mock.patch.dict(os.environ, env):  # read when the engine starts
            engines[arm], _ = make_engine(args.target, spec, 1, "float32")
    install_timers()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = read_prompts(Path(args.prompts), args.num_prompts + 1)
    for arm, engine in engines.items():  # warm-up
        run_prompt(engine, prompts[-1], params, f"warm-{arm}")
    steps: dict[str, list[dict[str, float]]] = {arm: [] for arm in engines}
    for i, prompt in enumerate(prompts[:-1]):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for arm in order:
            steps[arm] += run_prompt(engines[arm], prompt, params, f"{arm}-{i}")
    rows = [summarise(arm, steps[arm], args.k) for arm in engines]
    plain = rows[0]["engine_step_ms"]
    for row in rows[1:]:
        row["c"] = row["draft_step_ms"] / plain
        row["phase_vs_plain_step"] = row["draft_phase_ms"] / plain
    for row in rows:
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})
    del engines
    gc.collect()
    out = Path(args.out)
    save_json(
        out, "draft_profile", {"config": vars(args), "vllm": vllm.__version__, "results": rows}
    )
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
