"""`vllm-moa train` settings: one frozen dataclass, mapped one to one from the CLI."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("moa", "eagle", "independent")


@dataclass(frozen=True)
class TrainConfig:
    target: str
    data: tuple[str, ...]
    out: str
    max_steps: int
    drafter: str | None = None  # an existing drafter directory (e.g. from init-drafter) ...
    method: str = "moa"  # ... or a new one of this method, sized by `preset`
    preset: str = "small"
    tli: int = 0
    memory_source: str = "lsa"  # MoA only; "hidden" = the -LSA ablation
    seed: int = 0
    lr: float = 3e-4
    batch_size: int = 8
    grad_accum: int = 1
    max_length: int = 512
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kl_weight: float = 0.1  # lambda0
    feature_weight: float = 1.0  # lambda1
    refresh_min: int = 5  # K-step bounded CA: K ~ U[refresh_min, refresh_max] per sequence
    refresh_max: int = 15
    sa_staircase: bool = False  # SA sees only tokens since the last refresh in the 1st half
    feature_noise: float = 0.1  # EAGLE: uniform noise on input features, U(-a/2, a/2)
    save_every: int = 0  # 0 = only at the end
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    eval_examples: int = 32  # held out from the end of the data
    eval_refresh: int = 6  # K of the acceptance proxy
    resume: bool = False
    offline_cache: str | None = None  # directory of cached target features (built once)
    cache_workers: int = 1  # > 1: build the cache with that many Ray tasks (one GPU each)
    device: str = "cpu"
    autocast: str = "auto"  # auto: bf16 autocast on CUDA, none on CPU

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}")
        for name in ("max_steps", "batch_size", "grad_accum", "max_length", "log_every"):
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
