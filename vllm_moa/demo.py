"""`vllm-moa demo`: build (once, cached) a small trained target and a trained MoA drafter for it,
then decode a prompt plainly and speculatively and print both with their statistics.

No model can be downloaded, so the demo makes its own: a byte-level BPE tokenizer and a 4-layer
Llama trained for a minute or two on this Python's standard library sources, then a `small` MoA
drafter (TLI=0) distilled from it with `vllm-moa train`'s pipeline on the same text.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_moa.tiny import TinyTargetSpec, build_tiny_target, default_cache_dir, stdlib_sources

_DONE = ".complete"  # written last, so an interrupted build is redone


@dataclass(frozen=True)
class DemoRecipe:
    target_steps: int = 250
    drafter_steps: int = 250
    batch_size: int = 16
    seq_len: int = 128
    corpus_bytes: int = 1_500_000
    version: str = "demo-v2"  # the cache folder; bump when the recipe changes


def ensure_demo_models(
    cache_dir: str | Path | None = None, recipe: DemoRecipe | None = None
) -> tuple[Path, Path]:
    """Return (target_dir, drafter_dir), building and training them on first use."""
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.factories.methods import make_trainer
    from vllm_moa.hf_target import load_target_info
    from vllm_moa.training import TrainConfig
    from vllm_moa.training.pretrain import pretrain_target

    recipe = recipe or DemoRecipe()
    base = (Path(cache_dir) if cache_dir else default_cache_dir()) / recipe.version
    target_dir, drafter_dir = base / "target", base / "train" / "drafter"
    if (base / _DONE).exists():
        return target_dir, drafter_dir
    shutil.rmtree(base, ignore_errors=True)
    # progress on stderr: scripts/demo.sh reads the two paths from stdout
    print(
        f"building the demo target and drafter in {base} (once, a few minutes) ...",
        file=sys.stderr,
        flush=True,
    )
    corpus = stdlib_sources(recipe.corpus_bytes)
    build_tiny_target(target_dir, TinyTargetSpec(), corpus=corpus)
    pretrain_target(
        target_dir, corpus, recipe.target_steps, recipe.batch_size, recipe.seq_len, 2e-3, seed=0
    )
    drafter = MoADrafter(make_config(load_target_info(target_dir), preset="small", tli=0))
    drafter.init_weights(seed=0)
    init_dir = save_drafter(drafter, base / "drafter-init")
    make_trainer(
        TrainConfig(
            target=str(target_dir),
            data=tuple(map(str, corpus)),
            out=str(base / "train"),
            max_steps=recipe.drafter_steps,
            drafter=str(init_dir),
            lr=1e-3,
            batch_size=recipe.batch_size // 2,
            max_length=recipe.seq_len,
            warmup_steps=max(1, recipe.drafter_steps // 20),
            eval_examples=0,
        )
    ).train()
    (base / _DONE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return target_dir, drafter_dir
