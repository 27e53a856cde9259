"""One command, cached and resumable:

    python -m benchmarks.testbed --preset cpu --prompts ../shared/data/HumanEval.jsonl.gz \
        --out ~/.cache/vllm_moa/testbed-cpu --results benchmarks/results/testbed/testbed_cpu.json

1. builds and trains a small Llama target (BPE tokenizer + LM on the stdlib sources of this
   Python, plus --extra-text files); 2. trains MoA TLI=0, MoA TLI=1, MoA without LSA, EAGLE and
   an independent drafter against it with equal trainable parameters and training tokens;
3. evaluates each greedily with chains of K=4 and K=6 on held-out prompts, and plain decoding;
4. writes the results JSON (config, git SHA, machine, figures) and a PNG bar chart.
Every stage is skipped when its output exists; drafter training resumes from checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.results_paths import folder
from benchmarks.testbed.drafters import (
    EXTRA_METHODS,
    METHODS,
    SLIM_METHODS,
    align_stages,
    build_drafters,
    drafter_train_config,
    run_name,
)
from benchmarks.testbed.evaluate import evaluate_all, read_prompts
from benchmarks.testbed.presets import DEFAULT_MOA_REFRESH, PRESETS, TestbedConfig
from benchmarks.testbed.report import git_sha, write_report
from vllm_moa.cli.main import non_negative_int, positive_int
from vllm_moa.decoding.tree import TreeParams
from vllm_moa.training.pretrain import pretrain_target

TARGET_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_kv_heads", "intermediate_size",
    "target_steps", "target_batch", "target_lr", "seq_len", "corpus_bytes", "seed",
)  # fmt: skip
DRAFTER_FIELDS = ("drafter_steps", "drafter_batch", "drafter_lr", "seq_len", "seed", "drafter_seed")


def _settings(cfg: TestbedConfig, fields: tuple[str, ...]) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in fields}


def _cached(done: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """A finished stage's record, or None; refuses one made with other settings, which would
    otherwise be reused silently (records from before settings were kept are taken as they are)."""
    if not done.is_file():
        return None
    record: dict[str, Any] = json.loads(done.read_text())
    made = record.pop("settings", settings)
    changed = {k: (made.get(k), v) for k, v in settings.items() if made.get(k) != v}
    if changed:
        what = ", ".join(f"{k}={old} (now {new})" for k, (old, new) in changed.items())
        raise SystemExit(
            f"{done.parent} was made with {what}: give another --out for these settings, or "
            "the ones it was made with"
        )
    return record


def _target(out: Path, cfg: TestbedConfig, corpus: list[Path], device: str) -> dict[str, float]:
    from vllm_moa.tiny import TinyTargetSpec, build_tiny_target

    target_dir, done = out / "target", out / "target" / "pretrain.json"
    settings = _settings(cfg, TARGET_FIELDS)
    if (cached := _cached(done, settings)) is not None:
        return cached
    spec = TinyTargetSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.hidden_size // 64,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=1024,
        seed=cfg.seed,
    )
    build_tiny_target(target_dir, spec, corpus=corpus)
    stats = pretrain_target(
        target_dir,
        corpus,
        cfg.target_steps,
        cfg.target_batch,
        cfg.seq_len,
        cfg.target_lr,
        cfg.seed,
        device,
    )
    done.write_text(json.dumps({**stats, "settings": settings}))
    return stats


def _drafters(
    out: Path, cfg: TestbedConfig, corpus: list[Path], methods: list[str], device: str
) -> dict[str, dict[str, float]]:
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.factories.methods import make_trainer
    from vllm_moa.hf_target import load_target_info
    from vllm_moa.model.layers import count_parameters

    target_dir = out / "target"
    info = load_target_info(target_dir)
    stats = {}
    for method, drafter in build_drafters(info, cfg.seed_of_drafters, cfg.norm_init).items():
        if method not in methods:
            continue
        name = run_name(method, cfg)
        run = out / "drafters" / name
        done, settings = run / "done.json", _settings(cfg, DRAFTER_FIELDS)
        record = _cached(done, settings)
        if record is None:
            if method == "eagle3" and cfg.head_init == "target":
                from vllm_moa.factories.methods import init_head_from_target
                from vllm_moa.hf_target import HFTarget

                init_head_from_target(drafter, HFTarget.from_pretrained(str(target_dir)))
            init = save_drafter(drafter, out / "init" / name)
            t0 = time.perf_counter()
            stages, skip = align_stages(cfg), 0
            for i, stage in enumerate(stages, 1):  # one, unless --align-stages
                here = run if i == len(stages) else run / f"stage{i}"
                if not (here / "stage_done").is_file():
                    train = drafter_train_config(
                        stage, target_dir, corpus, here, init, device, method, skip
                    )
                    make_trainer(train).train()
                    (here / "stage_done").touch()
                init, skip = here / "drafter", skip + stage.drafter_steps
            record = {
                "parameters": count_parameters(drafter)["total"],
                "train_seconds": time.perf_counter() - t0,
            }
            done.write_text(json.dumps({**record, "settings": settings}))
        stats[name] = record
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.testbed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--prompts", required=True, help="held-out prompts, e.g. HumanEval.jsonl.gz")
    p.add_argument("--out", required=True, help="work directory (cached stages)")
    p.add_argument(
        "--results",
        default=None,
        help="results JSON path (PNG beside it); default: "
        "benchmarks/results/testbed/testbed_<preset>.json",
    )
    p.add_argument("--extra-text", nargs="*", default=[], help="more training text files")
    p.add_argument(
        "--methods",
        nargs="+",
        choices=[*METHODS, *SLIM_METHODS, *EXTRA_METHODS],
        default=list(METHODS),
        help=f"default: the five of the issue; {', '.join(SLIM_METHODS)}: MoA with a slim LSA; "
        "griffin: GRIFFIN's drafter",
    )
    p.add_argument(
        "--align-steps",
        type=positive_int,
        default=None,
        help="train every drafter of the run token-aligned (GRIFFIN) with N passes (the paper: "
        "3); such drafters are cached and reported as <method>_a<N>",
    )
    p.add_argument(
        "--align-topk",
        type=positive_int,
        default=None,
        help="k of --align-steps' mask (default 3, the paper's; another is reported as "
        "<method>_a<N>t<k>)",
    )
    p.add_argument(
        "--align-stages",
        action="store_true",
        default=None,
        help="with --align-steps N: GRIFFIN's staged schedule at the same total steps, N stages "
        "of drafter-steps / N, stage n trained with n passes from stage n-1's drafter, each "
        "continuing the data (reported as <method>_a<N>st)",
    )
    p.add_argument(
        "--eval-prompts",
        type=positive_int,
        default=None,
        help="how many prompts (override the preset's)",
    )
    p.add_argument(
        "--skip-prompts",
        type=non_negative_int,
        default=0,
        help="start after this many records of --prompts (a second held-out slice)",
    )
    p.add_argument("--target-steps", type=positive_int, default=None, help="override the preset's")
    p.add_argument(
        "--corpus-bytes",
        type=positive_int,
        default=None,
        help="override the preset's (stdlib text)",
    )
    p.add_argument("--drafter-steps", type=positive_int, default=None, help="override the preset's")
    p.add_argument(
        "--moa-refresh",
        nargs=2,
        type=int,
        metavar=("MIN", "MAX"),
        default=None,
        help="MoA's training K range (K-step bounded Cross-Attention, K ~ U[MIN, MAX]; default "
        f"{DEFAULT_MOA_REFRESH[0]} {DEFAULT_MOA_REFRESH[1]}, the paper's); other ranges are "
        "cached and reported as <method>_k<MIN>_<MAX>",
    )
    p.add_argument(
        "--sa-staircase",
        choices=("off", "half", "release"),
        default=None,
        help="MoA's SA staircase in training (vllm-moa train --sa-staircase); other than off: "
        "reported as <method>_stair<S>",
    )
    p.add_argument(
        "--ca-memory",
        choices=("inference", "release"),
        default=None,
        help="MoA's Cross-Attention training mask (vllm-moa train --ca-memory); release: "
        "reported as <method>_carelease",
    )
    p.add_argument(
        "--norm-init",
        choices=("ones", "normal"),
        default=None,
        help="MoA's RMSNorm initialisation (vllm-moa train --norm-init); normal: reported as "
        "<method>_normnormal",
    )
    p.add_argument(
        "--head-init",
        choices=("random", "target"),
        default=None,
        help="EAGLE-3's own norm and LM head from random (the authors') or the target's "
        "(vllm-moa train --head-init); target: reported as eagle3_headtarget",
    )
    p.add_argument(
        "--drafter-seed",
        type=int,
        default=None,
        help="the drafters' seed (default: the preset's, as the target's); drafters of another "
        "seed are cached and reported as <method>_s<SEED> (the spread over drafter seeds)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu or cuda (default: cuda if available): training (bf16 autocast on CUDA) and the "
        "evaluation (fp32)",
    )
    p.add_argument(
        "--tree",
        nargs=3,
        type=int,
        metavar=("DEPTH", "BREADTH", "BUDGET"),
        default=None,
        help="also evaluate every drafter with EAGLE-2 trees (the paper: 6 8 62)",
    )
    args = p.parse_args(argv)
    from vllm_moa.devices import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    if args.moa_refresh is not None:
        lo, hi = args.moa_refresh
        if not 1 <= lo <= hi:
            p.error(f"--moa-refresh needs 1 <= MIN <= MAX, got {lo} {hi}")
        args.moa_refresh = (lo, hi)
    overrides = (
        "eval_prompts", "target_steps", "corpus_bytes", "drafter_steps", "moa_refresh",
        "drafter_seed", "align_steps", "align_topk", "align_stages", "sa_staircase", "ca_memory",
        "norm_init", "head_init",
    )  # fmt: skip
    cfg = PRESETS[args.preset].replace(
        **{k: v for k in overrides if (v := getattr(args, k)) is not None}
    )
    try:
        align_stages(cfg)
    except ValueError as e:
        p.error(str(e))
    if cfg.drafter_seed == cfg.seed:  # the default, however it was spelled (one cache name)
        cfg = cfg.replace(drafter_seed=None)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    from vllm_moa.tiny import stdlib_sources

    corpus = [*stdlib_sources(cfg.corpus_bytes), *map(Path, args.extra_text)]
    t0, sha = time.perf_counter(), git_sha()  # the code this run started with
    target_stats = _target(out, cfg, corpus, device)
    drafter_stats = _drafters(out, cfg, corpus, args.methods, device)
    prompts = read_prompts(Path(args.prompts), cfg.eval_prompts, args.skip_prompts)
    if not prompts:
        raise SystemExit(f"no prompts in {args.prompts} after the first {args.skip_prompts}")
    drafter_dirs = {n: out / "drafters" / n / "drafter" for n in drafter_stats}
    tree = TreeParams(*args.tree) if args.tree else None
    results = Path(args.results or folder("testbed") / f"testbed_{args.preset}.json")

    def report(figures: dict[str, Any], complete: bool) -> None:
        """The results JSON: after each drafter's evaluation (partial), and at the end."""
        write_report(
            results,
            {
                "preset": args.preset,
                "config": dataclasses.asdict(cfg),
                "prompts": args.prompts,
                "skipped_prompts": args.skip_prompts,
                "device": device,
                "git_sha": sha,
                "target_training": target_stats,
                "drafter_training": drafter_stats,
                "results": figures,
                "complete": complete,
                "total_seconds": time.perf_counter() - t0,
            },
            cfg.ks,
        )

    figures = evaluate_all(
        out / "target",
        drafter_dirs,
        prompts,
        cfg.eval_new_tokens,
        cfg.ks,
        tree,
        device,
        on_method=lambda so_far: report(so_far, complete=False),
    )
    report(figures, complete=True)
    print(f"results: {results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
