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
from typing import Any, Literal, get_args

from vllm_moa.kinds import kind_names

Preset = Literal["small", "paper"]  # vllm_moa/drafters/presets.py PRESETS
MemorySource = Literal["lsa", "hidden"]  # vllm_moa/drafters/moa/config.py MEMORY_SOURCES
Autocast = Literal["auto", "bf16", "none"]  # vllm_moa/devices.py training_autocast
Staircase = Literal["off", "half", "release"]  # vllm_moa/training/schedule.py
CaMemory = Literal["inference", "release"]  # vllm_moa/training/schedule.py memory_limits
NormInit = Literal["ones", "normal"]  # vllm_moa/drafters/moa/model.py init_weights
HeadInit = Literal["random", "target"]  # vllm_moa/drafters/eagle3/model.py init_head_from


@dataclass(frozen=True)
class Alignment:
    """Token-aligned training (training/alignment.py): `steps` passes (1 = off), the top-k of
    their mask (0 = no mask), pass n's loss weighted decay^(n-1)."""

    steps: int
    topk: int
    decay: float


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
    skip_steps: int = field(
        default=0,
        metadata={
            "min": 0,
            "help": "continue the data stream of an earlier run of this many steps: batches and "
            "random draws are those of steps N+1.. (with --drafter OUT/drafter: a stage of a "
            "staged schedule; the learning-rate schedule starts afresh)",
        },
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
    sa_staircase: Staircase = field(
        default="off",
        metadata={
            "help": "MoA: SA sees only the tokens since its cycle's start (the MoA authors' "
            "'staircase'): half = every sequence in the first half of the steps, release = the "
            "authors' schedule, each sequence with probability falling from 1 to 0 over the first "
            "half (docs/training.md, 'The MoA recipe')",
        },
    )
    ca_memory: CaMemory = field(
        default="inference",
        metadata={
            "help": "MoA: the Cross-Attention's training mask: inference = as drafts see the "
            "memory (the rows before their cycle's first position); release = the MoA authors' "
            "(refresh points every K from the sequence start, where a query also sees its own "
            "row); TLI 0 and no --align-steps only",
        },
    )
    norm_init: NormInit = field(
        default="ones",
        metadata={
            "help": "MoA: a new drafter's RMSNorm weights: ones, or normal = N(0, 0.02) as the "
            "MoA authors' code initialises them",
        },
    )
    head_init: HeadInit = field(
        default="random",
        metadata={
            "help": "EAGLE-3: a new drafter's own final norm and LM head start from random (the "
            "authors') or from the target's (copied, then trained)",
        },
    )
    draft_vocab: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "help": "EAGLE-3 and MoA: drafts only ever pick the N target tokens the training "
            "data trains on most often, the reduced draft vocabulary (EAGLE-3: a new drafter's "
            "LM head has N rows, the authors' draft_vocab_size, docs/eagle3.md; MoA: its drafts "
            "read those N rows of the target's LM head, an inference-time choice a --drafter "
            "can take too, the loss unchanged, docs/training.md). Default: the whole vocabulary",
        },
    )
    feature_noise: float = field(
        default=0.1,
        metadata={"help": "EAGLE: uniform noise U(-a/2, a/2) on input features, a = this"},
    )
    align_steps: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "help": "token-aligned training (GRIFFIN, HASS; EAGLE-3's training-time test): N "
            "forward passes, pass n feeding the drafter its own predictions of pass n-1 as at "
            "inference, a position trained only while the data's tokens of its cycle's earlier "
            "drafts were in the drafter's top-k (docs/training.md); 1 = off (the GRIFFIN paper: "
            "3). Default: the method's recipe (EAGLE-3: 7, the others: 1)",
        },
    )
    align_topk: int | None = field(
        default=None,
        metadata={
            "min": 0,
            "help": "k of --align-steps' mask: a draft is right when the data's token is among "
            "its top-k; 0 = no mask (every position trains, EAGLE-3's). Default: the method's "
            "recipe (EAGLE-3: 0, the others: the GRIFFIN paper's 3)",
        },
    )
    align_decay: float | None = field(
        default=None,
        metadata={
            "help": "weight of --align-steps' pass n: this^(n-1). Default: the method's recipe "
            "(EAGLE-3: 0.8, the others: 1)",
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
        if isinstance(self.sa_staircase, bool):  # train_config.json written before the choices
            object.__setattr__(self, "sa_staircase", "half" if self.sa_staircase else "off")
        choices = {
            "sa_staircase": Staircase,
            "ca_memory": CaMemory,
            "norm_init": NormInit,
            "head_init": HeadInit,
        }
        for name, kind in choices.items():
            if getattr(self, name) not in get_args(kind):
                raise ValueError(
                    f"{name} must be one of {list(get_args(kind))}, got {getattr(self, name)!r}"
                )
        if self.ca_memory == "release" and (self.tli or (self.align_steps or 1) > 1):
            raise ValueError(
                "ca_memory 'release' (the MoA authors' mask) is for TLI 0 without token "
                "alignment: drop --ca-memory release, or train with --tli 0 and no --align-steps"
            )
        if self.method not in kind_names():
            raise ValueError(f"method must be one of {list(kind_names())}, got {self.method!r}")
        positive = ("max_steps", "batch_size", "grad_accum", "max_length", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
        if self.align_steps is not None and self.align_steps < 1:
            raise ValueError(f"align_steps must be >= 1, got {self.align_steps}")
        if self.align_topk is not None and self.align_topk < 0:
            raise ValueError(f"align_topk must be >= 0, got {self.align_topk}")
        if self.align_decay is not None and not 0 < self.align_decay <= 1:
            raise ValueError(f"align_decay must be in (0, 1], got {self.align_decay}")
        non_negative = ("save_every", "eval_every", "warmup_steps", "eval_examples", "tli")
        for name in (*non_negative, "skip_steps"):
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

    def alignment(self, recipe: tuple[int, int, float] | None) -> Alignment:
        """The token-aligned training this run does: the flags given, else the drafter kind's
        recipe (`DrafterKind.alignment`), else off (top-k 3 and no decay when turned on)."""
        steps, topk, decay = recipe or (1, 3, 1.0)
        return Alignment(
            steps=steps if self.align_steps is None else self.align_steps,
            topk=topk if self.align_topk is None else self.align_topk,
            decay=decay if self.align_decay is None else self.align_decay,
        )

    def with_alignment(self, recipe: tuple[int, int, float] | None) -> TrainConfig:
        """This config with its alignment resolved (`alignment`), as the run records it."""
        a = self.alignment(recipe)
        return dataclasses.replace(
            self, align_steps=a.steps, align_topk=a.topk, align_decay=a.decay
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
