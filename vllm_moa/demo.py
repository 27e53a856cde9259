"""`vllm-moa demo` and `scripts/demo.sh`: build (once, cached) a small trained target and a trained
MoA drafter for it, widen both into a pair of realistic cost, and compare plain decoding with MoA.

No model can be downloaded, so the demo makes its own: a byte-level BPE tokenizer and a 4-layer
Llama trained for a minute or two on this Python's standard library sources, then a `small` MoA
drafter (TLI=0) distilled from it with `vllm-moa train`'s pipeline on the same text. On a pair
that small a draft step costs about what a target step costs, so speculation cannot pay (and
adaptive speculation rightly stops drafting); `vllm-moa inflate` then widens the pair into a
182M-parameter target with a ~20M drafter computing the same logits (the ratio of a served 8B
target and its drafter, roughly), where the drafts it accepts buy wall-clock time.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from collections.abc import Sequence
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
    # the widened pair (`vllm-moa inflate`): residual width, MLP width, query heads
    wide: tuple[int, int, int] = (2048, 5632, 32)
    version: str = "demo-v2"  # the cache folder; bump when the recipe changes


# Python openings the demo target (trained on the standard library) continues
PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef list_files(path):\n",
    "def is_prime(n):\n",
)


def ensure_demo_models(
    cache_dir: str | Path | None = None, recipe: DemoRecipe | None = None
) -> tuple[Path, Path]:
    """Return (target_dir, drafter_dir) of the widened pair, building, training and widening
    them on first use."""
    recipe = recipe or DemoRecipe()
    base = (Path(cache_dir) if cache_dir else default_cache_dir()) / recipe.version
    target_dir, drafter_dir = _ensure_small_pair(base, recipe)
    wide = base / f"wide-{'-'.join(map(str, recipe.wide))}"
    if not (wide / _DONE).exists():
        from vllm_moa.checkpoint.inflate import inflate_drafter, inflate_target

        shutil.rmtree(wide, ignore_errors=True)
        print(f"widening the demo pair into {wide} ...", file=sys.stderr, flush=True)
        widening = inflate_target(target_dir, wide / "target", *recipe.wide)
        inflate_drafter(drafter_dir, wide / "drafter", widening)
        (wide / _DONE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return wide / "target", wide / "drafter"


def _ensure_small_pair(base: Path, recipe: DemoRecipe) -> tuple[Path, Path]:
    """The small trained pair (target, drafter) in `base`, built on first use."""
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.factories.methods import make_trainer
    from vllm_moa.hf_target import load_target_info
    from vllm_moa.training import TrainConfig
    from vllm_moa.training.pretrain import pretrain_target

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


@dataclass(frozen=True)
class Arm:
    """One decoding mode over the demo's prompts: its texts and speed."""

    name: str
    texts: list[str]
    token_ids: list[list[int]]
    tokens_per_s: list[float]  # per round, over all prompts
    tokens_per_target_pass: float  # decoding passes only (the prefill excluded), last round

    @property
    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s)


@dataclass(frozen=True)
class Comparison:
    plain: Arm
    moa: Arm

    @property
    def identical(self) -> int:
        """Prompts whose MoA output equals plain decoding's, token for token."""
        return sum(a == b for a, b in zip(self.plain.token_ids, self.moa.token_ids, strict=True))

    @property
    def speedup(self) -> float:
        """The median over rounds of MoA's tokens/s over plain's in the same round."""
        pairs = zip(self.moa.tokens_per_s, self.plain.tokens_per_s, strict=True)
        return statistics.median(m / p for m, p in pairs)


def compare(
    target_dir: str | Path,
    drafter_dir: str | Path,
    prompts: Sequence[str] = PROMPTS,
    max_new_tokens: int = 64,
    num_speculative_tokens: int = 4,
    rounds: int = 3,
) -> Comparison:
    """Greedy plain decoding and MoA (adaptive speculation, the default) on the standalone
    engine, one target for both, in alternating rounds over all prompts after a warm-up."""
    import torch
    from transformers import AutoTokenizer

    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.factories.proposers import make_proposer
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.hf_target.eos import eos_ids

    target = HFTarget.from_pretrained(str(target_dir), dtype=torch.float32, device="cpu")
    drafter = load_drafter(drafter_dir, target=target.shape, dtype=torch.float32, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    engines = {
        "plain": SpeculativeEngine(target),
        "moa": SpeculativeEngine(target, make_proposer(drafter, target)),
    }
    eos = eos_ids(tokenizer, target.model)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]

    def run(name: str, ids: list[int], n: int) -> tuple[list[int], int, int, float]:
        began = time.perf_counter()
        out = engines[name].generate(
            ids, n, num_speculative_tokens=num_speculative_tokens, eos_token_ids=eos
        )
        seconds = time.perf_counter() - began
        return out.token_ids, out.stats.num_generated_tokens, out.stats.num_cycles, seconds

    for name in engines:  # warm-up (and adaptive speculation's first measurements)
        run(name, encoded[0], 8)
    speed: dict[str, list[float]] = {name: [] for name in engines}
    last: dict[str, list[tuple[list[int], int, int, float]]] = {}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            last[name] = [run(name, ids, max_new_tokens) for ids in encoded]
            tokens = sum(x[1] for x in last[name])
            speed[name].append(tokens / sum(x[3] for x in last[name]))

    def arm(name: str) -> Arm:
        ids = [x[0] for x in last[name]]
        # decoding passes: the first token of each request comes from the prefill
        passes = sum(x[2] for x in last[name])
        per_pass = sum(x[1] - 1 for x in last[name]) / passes if passes else 1.0
        texts = [str(tokenizer.decode(t, skip_special_tokens=True)) for t in ids]
        return Arm(name, texts, ids, speed[name], per_pass)

    return Comparison(arm("plain"), arm("moa"))
