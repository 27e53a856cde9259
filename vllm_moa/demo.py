"""`vllm-moa demo`: build (once, cached) the tiny default target and a drafter, then generate."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from vllm_moa.tiny import TinyTargetSpec, build_tiny_target, default_cache_dir

_DONE = ".complete"  # written last, so an interrupted build is redone


def ensure_demo_models(cache_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Return (target_dir, drafter_dir), building them on first use."""
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.model import MoADrafter, make_config
    from vllm_moa.target import load_target_info

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    base = root / "demo-v1"
    target_dir, drafter_dir = base / "target", base / "drafter-tli0"
    if (base / _DONE).exists():
        return target_dir, drafter_dir
    shutil.rmtree(base, ignore_errors=True)
    print(f"building the tiny demo target and drafter in {base} (once) ...", flush=True)
    build_tiny_target(target_dir, TinyTargetSpec())
    drafter = MoADrafter(make_config(load_target_info(target_dir), preset="small", tli=0))
    drafter.init_weights(seed=0)
    save_drafter(drafter, drafter_dir)
    (base / _DONE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return target_dir, drafter_dir


def run_demo(
    cache_dir: str | None, prompt: str, max_new_tokens: int, num_speculative_tokens: int
) -> int:
    from vllm_moa.cli.commands import _print_stats, run_generation

    target_dir, drafter_dir = ensure_demo_models(cache_dir)
    print(f"target:  {target_dir}\ndrafter: {drafter_dir}\nprompt:  {prompt!r}\n")
    runs = {}
    for name, drafter in (("plain", None), ("moa", str(drafter_dir))):
        runs[name] = record = run_generation(
            str(target_dir),
            drafter,
            prompt,
            max_new_tokens=max_new_tokens,
            num_speculative_tokens=num_speculative_tokens,
        )
        print(f"--- {name} decoding (greedy) ---")
        print(record["text"])
        _print_stats(record)
        print()
    same = runs["plain"]["token_ids"] == runs["moa"]["token_ids"]
    print(f"speculative output identical to plain greedy decoding: {same}")
    print(
        "note: the demo target and drafter are randomly initialised, so the text is noise and "
        "acceptance is near zero; train a drafter to see real acceptance."
    )
    return 0 if same else 1
