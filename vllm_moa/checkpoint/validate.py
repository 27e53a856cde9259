"""Check a drafter directory against a target before anything is built from it.

Reads config.json and the header of model.safetensors only (no weights), so a server can refuse
a bad drafter in its config step, in a second, with one message naming what is wrong and how to
fix it: a directory that is not a drafter (a model, an empty folder), a drafter built for another
target (layer count, KV width, vocabulary), a missing, truncated or corrupt weights file, or one
whose tensors do not match its config in name, shape or dtype (checkpoint/io.py's checks, which
load_drafter runs too, reading the values for NaN / Inf besides).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_moa.checkpoint.io import (
    CONFIG_NAME,
    NOT_A_DRAFTER_DIR,
    WEIGHTS_NAME,
    DrafterCheckError,
    buffer_dtypes,
    check_header,
    check_target,
    load_config,
    read_header,
)
from vllm_moa.kinds import BY_MODEL_TYPE
from vllm_moa.model.config import DrafterConfig, TargetShape

__all__ = ["DrafterCheckError", "check_drafter_dir", "expected_shapes", "trained_chain_range"]

TRAIN_CONFIG_NAME = "train_config.json"  # written by `vllm-moa train` beside its drafter/


def check_drafter_dir(path: str | Path, target: TargetShape | None = None) -> DrafterConfig:
    """The drafter config at `path`, after checking its config, its target shape (if `target`)
    and its weights file's header. Raises DrafterCheckError."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise DrafterCheckError(
            f"{path} is not a drafter directory (no {CONFIG_NAME}); " + NOT_A_DRAFTER_DIR
        )
    config = load_config(path)
    if target is not None:
        check_target(config, target, path)
    check_weights_file(path, config)
    return config


def _meta_state(config: DrafterConfig) -> dict[str, torch.Tensor]:
    """The state dict of the drafter of `config`, built on the meta device (no memory)."""
    with torch.device("meta"):
        module = BY_MODEL_TYPE[config.MODEL_TYPE].load("module")(config)
    return dict(module.state_dict())


def expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the drafter of `config` stores (built on the meta device)."""
    return {name: tuple(t.shape) for name, t in _meta_state(config).items()}


def check_weights_file(path: Path, config: DrafterConfig) -> None:
    """Names, shapes and dtypes of the weights, from the file's header (NaN / Inf values are
    found when load_drafter reads the data)."""
    file = path / WEIGHTS_NAME
    try:
        header = read_header(file)
    except FileNotFoundError as e:
        raise DrafterCheckError(str(e)) from None
    state = _meta_state(config)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    check_header(header, shapes, file, buffer_dtypes(state))


def trained_chain_range(path: str | Path) -> tuple[int, int] | None:
    """(shortest, longest) draft chain the drafter was trained to make (MoA's K-step bounded
    cross-attention: K ~ U[refresh_min, refresh_max]), from its config.json's `training` record
    or the `vllm-moa train` run's train_config.json beside it; None if unknown."""
    path = Path(path)
    sources = [(path / CONFIG_NAME, "training"), (path.parent / TRAIN_CONFIG_NAME, None)]
    for file, key in sources:
        try:
            data = json.loads(file.read_text())
            record = data[key] if key else data
            return int(record["refresh_min"]), int(record["refresh_max"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None
