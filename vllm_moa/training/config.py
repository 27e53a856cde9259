"""`vllm-moa train` settings: one frozen dataclass; the CLI's flags are built from its fields.

Each field is one flag (`max_steps` -> `--max-steps`; vllm_moa/cli/main.py
`add_dataclass_flags`): choices are `Literal` types, a field without a default is a required
flag, a bool is a store_true flag, a tuple takes one or more values. The field's `metadata`
holds the rest: `help`; `min`, an int's lower bound checked by the parser (0 or 1); `group`,
a mutually exclusive group of the fields naming it; `cli_default`, the flag's default where it
is not the field's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vllm_moa.kinds import kind_names

Preset = Literal["small", "paper"]  # vllm_moa/drafters/presets.py PRESETS
MemorySource = Literal["lsa", "hidden"]  # vllm_moa/drafters/moa/config.py MEMORY_SOURCES
Autocast = Literal["auto", "bf16", "none"]  # vllm_moa/devices.py training_autocast


@dataclass(frozen=True)
class TrainConfig:
    target: str = field(metadata={"help": "target model directory (Hugging Face)"})
    data: tuple[str, ...] = field(
        metadata={
            "help": "JSONL, Parquet, Arrow or text files, or save_to_disk dirs "
            "(layouts: docs/training.md)"
        }
    )
    out: str = field(metadata={"help": "output directory (drafter in OUT/drafter)"})
    max_steps: int = field(metadata={"min": 1, "help": "optimizer steps"})
    # An existing drafter directory (e.g. from init-drafter) or a new one of `method`.
    drafter: str | None = field(
        default=None, metadata={"group": "drafter", "help": "drafter directory to start from"}
    )
    method: str = field(
        default="moa",
        metadata={
            "group": "drafter",
            "help": "else a new drafter of this method, sized by --preset",
            "choices": kind_names,  # the registered drafter kinds (vllm_moa/kinds.py)
        },
    )
    preset: Preset = field(
        default="small", metadata={"help": "size of a new drafter (as init-drafter's)"}
    )
    tli: int = field(default=0, metadata={"min": 0, "help": "MoA: target layers to reuse"})
    memory_source: MemorySource = field(
        default="lsa",
        metadata={"help": "MoA only: what the Cross-Attention reads; hidden = the -LSA ablation"},
    )
    seed: int = field(
        default=0, metadata={"help": "seed of the initialisation, batch order and random draws"}
    )
    lr: float = field(default=3e-4, metadata={"help": "peak learning rate (AdamW)"})
    batch_size: int = field(
        default=8, metadata={"min": 1, "help": "sequences per micro-batch (per process)"}
    )
    grad_accum: int = field(
        default=1, metadata={"min": 1, "help": "micro-batches per optimizer step"}
    )
    max_length: int = field(
        default=512, metadata={"min": 1, "help": "tokens per sequence (longer text is cut)"}
    )
    warmup_steps: int = field(default=20, metadata={"min": 0, "help": "linear warmup steps"})
    min_lr_ratio: float = field(
        default=0.1, metadata={"help": "cosine decay to lr * MIN_LR_RATIO at --max-steps"}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clipping threshold"})
    kl_weight: float = field(
        default=0.1, metadata={"help": "lambda0: weight of KL(target || drafter)"}
    )
    feature_weight: float = field(
        default=1.0, metadata={"help": "lambda1: weight of the SmoothL1 feature loss"}
    )
    refresh_min: int = field(
        default=5,
        metadata={
            "min": 1,
            "help": "MoA: the Cross-Attention's memory is K-step bounded, K ~ U[min, max] per "
            "sequence (the paper's 5..15); a top near the drafting depth (e.g. 3..8 for depth 6) "
            "can raise the first draft's acceptance (benchmarks/testbed/README.md, 'The training K "
            "range')",
        },
    )
    refresh_max: int = field(default=15, metadata={"min": 1, "help": "see --refresh-min"})
    sa_staircase: bool = field(
        default=False,
        metadata={"help": "MoA: SA sees only the tokens since the last refresh in the 1st half"},
    )
    feature_noise: float = field(
        default=0.1,
        metadata={"help": "EAGLE: uniform noise U(-a/2, a/2) on input features, a = this"},
    )
    align_steps: int = field(
        default=1,
        metadata={
            "min": 1,
            "help": "token-aligned training (GRIFFIN, HASS): N forward passes, pass n feeding the "
            "drafter its own predictions of pass n-1 as at inference, a position trained only "
            "while the data's tokens of its cycle's earlier drafts were in the drafter's top-k "
            "(docs/training.md); 1 = off (the paper: 3)",
        },
    )
    align_topk: int = field(
        default=3,
        metadata={
            "min": 1,
            "help": "k of --align-steps' mask: a draft is right when the data's token is among "
            "its top-k (the paper's 3)",
        },
    )
    save_every: int = field(
        default=0, metadata={"min": 0, "help": "checkpoint every N steps (0 = only at the end)"}
    )
    log_every: int = field(default=10, metadata={"min": 1, "help": "log every N steps"})
    eval_every: int = field(
        default=0, metadata={"min": 0, "help": "evaluate every N steps (0 = only at the end)"}
    )
    eval_examples: int = field(
        default=32, metadata={"min": 0, "help": "examples held out from the end of the data"}
    )
    eval_refresh: int = field(
        default=6, metadata={"min": 1, "help": "K of the held-out acceptance proxy"}
    )
    resume: bool = field(default=False, metadata={"help": "continue from OUT/checkpoint.pt"})
    offline_cache: str | None = field(
        default=None,
        metadata={
            "help": "directory for the target's features: computed once, then training reads them"
        },
    )
    cache_workers: int = field(
        default=1,
        metadata={
            "min": 1,
            "help": "build the offline cache with N Ray tasks (one GPU each); needs `pip install "
            "ray`",
        },
    )
    # The CLI's default is None: vllm_moa.devices.resolve_device picks cuda when available.
    device: str = field(
        default="cpu",
        metadata={"cli_default": None, "help": "cpu or cuda (default: cuda if available)"},
    )
    autocast: Autocast = field(
        default="auto",
        metadata={"help": "bf16 autocast (fp32 master weights): auto = on CUDA only, bf16, none"},
    )

    def __post_init__(self) -> None:
        if self.method not in kind_names():
            raise ValueError(f"method must be one of {list(kind_names())}, got {self.method!r}")
        positive = ("max_steps", "batch_size", "grad_accum", "max_length", "log_every")
        for name in (*positive, "align_steps", "align_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "eval_every", "warmup_steps", "eval_examples", "tli"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 1 <= self.refresh_min <= self.refresh_max:
            raise ValueError(
                f"need 1 <= refresh_min <= refresh_max, got {self.refresh_min}, {self.refresh_max}"
            )
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if not self.data:
            raise ValueError("give at least one data file")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
