"""Drafting cost inside vLLM per generated token, against context length: MoA vs vLLM's EAGLE.

    python -m benchmarks.draft_cost --target DIR \
        --out benchmarks/results/draft_cost/draft_cost_cpu.json \
        [--drafter MOA_DIR] [--eagle EAGLE_DIR] [--prompt-lens 64 3072] [--batch 8] [--k 4]

Without --drafter / --eagle, randomly initialised drafters (MoA `small` TLI=0, EAGLE `small`)
are built for the target, so that both accept about nothing (tau ~ 1) and run the same number of
draft steps: the comparison is then of drafting cost alone. One in-process engine per method
(plain, moa, eagle: vLLM's own method on our exported EAGLE), in vLLM's default
mode (compiled target; `--enforce-eager` for eager), prefix caching off,
the target's maximum length raised to fit the longest prompt (a copy of its config.json beside
links to its weights). Per prompt length and round: `--batch` requests of random token ids,
generated once with `--short` and once with `--long` new tokens (ignore_eos, greedy, fresh
prompts each time); the difference of the two cancels the prefill, leaving the steady-state
decode cost: wall time and the time spent in the model runner's `propose_draft_token_ids`
(timed around it), each per generated token. All engines live in one process and take turns
on the same prompts within a round (alternate order each round); medians over rounds, and MoA /
EAGLE as the median of per-round ratios. Writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_MOA_ADAPTIVE", "0")  # drafting cost at the fixed K

PROPOSE_SECONDS = [0.0]  # time in the runner's propose_draft_token_ids since the last reset


def time_proposer() -> None:
    """Wrap the V1 runner's propose_draft_token_ids (after the plugin's own patch) in a timer."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    inner = GPUModelRunner.propose_draft_token_ids
    if getattr(inner, "_timed", False):
        return

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            PROPOSE_SECONDS[0] += time.perf_counter() - start

    timed._timed = True  # type: ignore[attr-defined]
    GPUModelRunner.propose_draft_token_ids = timed  # type: ignore[method-assign]


def long_target(target: str, max_len: int, where: Path) -> str:
    """A view of `target` whose config admits `max_len` positions (weights linked, not copied)."""
    config = json.loads((Path(target) / "config.json").read_text())
    if int(config.get("max_position_embeddings", 0)) >= max_len:
        return target
    out = where / "target"
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(target).iterdir():
        if item.name != "config.json" and not (out / item.name).exists():
            (out / item.name).symlink_to(item.resolve())
    config["max_position_embeddings"] = max_len
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def random_drafters(target: str, where: Path) -> tuple[str, str]:
    """Randomly initialised MoA (small, TLI=0) and EAGLE (small) drafters for `target`."""
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.eagle.model import EagleDrafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config, make_eagle_config
    from vllm_moa.hf_target import load_target_info

    info = load_target_info(target)
    moa = MoADrafter(make_config(info, preset="small", tli=0))
    moa.init_weights(seed=0)
    eagle = EagleDrafter(make_eagle_config(info, "small"))
    eagle.init_weights(seed=0)
    return str(save_drafter(moa, where / "moa")), str(save_drafter(eagle, where / "eagle"))


def generate(
    engine: Any, prompts: list[list[int]], max_tokens: int, tag: str
) -> tuple[float, float, int]:
    """(wall s, proposer s, output tokens) of one batch submitted together."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    PROPOSE_SECONDS[0] = 0.0
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=ids), params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, PROPOSE_SECONDS[0], tokens


def measure(engines: dict[str, Any], args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Rows per method and prompt length. Each round runs every engine on the same prompts, in
    alternate order from round to round, so that drift on the machine hits all methods alike;
    MoA / EAGLE is the median of the per-round ratios."""
    import torch

    gen = torch.Generator().manual_seed(1234)

    def prompts(length: int) -> list[list[int]]:
        return torch.randint(3, vocab, (args.batch, length), generator=gen).tolist()

    rows = []
    for length in args.prompt_lens:
        for method, engine in engines.items():
            generate(engine, prompts(length), args.short, f"warm-{method}-{length}")
        wall: dict[str, list[float]] = {m: [] for m in engines}
        prop: dict[str, list[float]] = {m: [] for m in engines}
        for r in range(args.rounds):
            short, long = prompts(length), prompts(length)
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for method in order:
                engine = engines[method]
                w_s, p_s, t_s = generate(engine, short, args.short, f"s{length}-{r}")
                w_l, p_l, t_l = generate(engine, long, args.long, f"l{length}-{r}")
                wall[method].append((w_l - w_s) / (t_l - t_s))
                prop[method].append((p_l - p_s) / (t_l - t_s))
        for method in engines:
            row: dict[str, Any] = {
                "method": method,
                "prompt_tokens": length,
                "wall_ms_per_token": 1e3 * statistics.median(wall[method]),
                "propose_ms_per_token": 1e3 * statistics.median(prop[method]),
                "wall_ms_per_token_rounds": [1e3 * w for w in wall[method]],
                "propose_ms_per_token_rounds": [1e3 * p for p in prop[method]],
            }
            if method == "moa" and "eagle" in engines:
                ratios = [m / e for m, e in zip(prop["moa"], prop["eagle"], strict=True) if e > 0]
                row["propose_vs_eagle_rounds"] = ratios
                row["propose_vs_eagle"] = statistics.median(ratios)
            print(
                json.dumps({k: v for k, v in row.items() if not k.endswith("rounds")}), flush=True
            )
            rows.append(row)
    return rows


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax, title in (
        ("propose_ms_per_token", axes[0], "drafting (propose_draft_token_ids)"),
        ("wall_ms_per_token", axes[1], "wall time"),
    ):
        for i, method in enumerate(dict.fromkeys(r["method"] for r in rows)):
            mine = [r for r in rows if r["method"] == method]
            if key == "propose_ms_per_token" and method == "plain":
                continue
            xs, ys = [r["prompt_tokens"] for r in mine], [r[key] for r in mine]
            ax.plot(xs, ys, "o-", color=f"C{i}", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms per generated token (steady state)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from benchmarks.testbed.report import add_out_argument, save_json
    from benchmarks.throughput import make_engine, vllm_eagle_dir
    from vllm_moa.vllm_plugin.compiled import COMPILE_ENV

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None, help="MoA drafter (default: a random one)")
    p.add_argument("--eagle", default=None, help="EAGLE drafter of ours (default: a random one)")
    add_out_argument(p, "draft_cost")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 3072])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--methods",
        nargs="+",
        default=["plain", "moa", "eagle"],
        choices=["plain", "moa", "moa_eager", "eagle"],
        help="moa_eager: MoA with its proposer not compiled (as with --enforce-eager)",
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="eager target (default: compiled, as served)"
    )
    args = p.parse_args()

    import vllm

    work = Path(tempfile.mkdtemp(prefix="draft_cost_"))
    max_len = max(args.prompt_lens) + args.long + args.k + 8
    target = long_target(args.target, max_len, work)
    moa, eagle = args.drafter, args.eagle
    if moa is None or eagle is None:
        random_moa, random_eagle = random_drafters(args.target, work / "random")
        moa, eagle = moa or random_moa, eagle or random_eagle
    eagle_method, eagle_model = vllm_eagle_dir(eagle, target)  # the long view: its max length
    specs: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "moa": {"method": "moa", "model": moa, "num_speculative_tokens": args.k},
        "eagle": {"method": eagle_method, "model": eagle_model, "num_speculative_tokens": args.k},
    }
    vocab = int(json.loads((Path(args.target) / "config.json").read_text())["vocab_size"])
    specs["moa_eager"] = specs["moa"]  # MoA with its proposer not compiled
    engines = {}
    for method in args.methods:
        # moa_eager: the proposer reads VLLM_MOA_COMPILE when it loads.
        eager_proposer = {COMPILE_ENV: "0"} if method == "moa_eager" else {}
        with mock.patch.dict(os.environ, eager_proposer):
            engines[method], _ = make_engine(
                target, specs[method], args.batch, "float32", args.enforce_eager,
                max_model_len=max_len, enable_prefix_caching=False,
            )  # fmt: skip
    time_proposer()
    rows = measure(engines, args, vocab)
    del engines
    gc.collect()
    out = Path(args.out)
    config = {**vars(args), "drafter": moa, "eagle": eagle, "random_drafters": args.drafter is None}
    save_json(out, "draft_cost", {"config": config, "vllm": vllm.__version__, "results": rows})
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
