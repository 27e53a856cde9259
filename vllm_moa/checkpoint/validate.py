"""Check a drafter directory against a target before anything is built from it.

Reads config.json and the header of model.safetensors only (no weights), so a server can refuse
a bad drafter in its config step, in a second, with one message naming what is wrong and how to
fix it: a directory that is not a drafter (a model, an empty folder), a drafter built for another
target (layer count, KV width, vocabulary), a missing, truncated or corrupt weights file, or one
whose tensors do not match its config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_moa.checkpoint.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_tensors,
    load_config,
)
from vllm_moa.kinds import BY_MODEL_TYPE
from vllm_moa.model.config import DrafterConfig, TargetShape

TRAIN_CONFIG_NAME = "train_config.json"  # written by `vllm-moa train` beside its drafter/


class DrafterCheckError(ValueError):
    """A drafter directory that cannot serve the target; the message says why and what to do."""


def check_drafter_dir(path: str | Path, target: TargetShape | None = None) -> DrafterConfig:
    """The drafter config at `path`, after checking its config, its target shape (if `target`)
    and its weights file's header. Raises DrafterCheckError."""
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise DrafterCheckError(
            f"{path} is not a drafter directory (no {CONFIG_NAME}); pass the drafter/ folder "
            "`vllm-moa train --out` wrote, or one made by `vllm-moa init-drafter`"
        )
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise DrafterCheckError(f"{config_file} is not a readable JSON object ({e})") from None
    if model_type not in BY_MODEL_TYPE:
        raise DrafterCheckError(
            f"{path} is not a vllm-moa drafter: its {CONFIG_NAME} has model_type "
            f"{model_type!r} (a model, not a drafter?), expected one of {sorted(BY_MODEL_TYPE)}. "
            "Pass the drafter's directory; for the authors' MoA release run "
            "`vllm-moa convert-official` first"
        )
    try:
        config = load_config(path)
    except (TypeError, ValueError) as e:
        raise DrafterCheckError(f"{config_file}: {e}") from None
    if target is not None:
        try:
            config.check_target(target)
        except ValueError as e:
            raise DrafterCheckError(f"drafter {path}: {e}") from None
    check_weights_file(path, config)
    return config


def expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the drafter of `config` stores (built on the meta device)."""
    with torch.device("meta"):
        module = BY_MODEL_TYPE[config.MODEL_TYPE].load("module")(config)
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


def check_weights_file(path: Path, config: DrafterConfig) -> None:
    from safetensors import SafetensorError, safe_open

    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise DrafterCheckError(
            f"{path} has no {WEIGHTS_NAME}; the drafter's weights are missing (an interrupted "
            "copy or training run?): copy them again or re-run `vllm-moa train`"
        )
    try:
        with safe_open(str(file), framework="pt") as f:
            stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise DrafterCheckError(
            f"{file} is truncated or not a safetensors file ({e}); copy it again or re-save "
            "the drafter"
        ) from None
    try:
        check_tensors(expected_shapes(config), stored, str(file))
    except ValueError as e:
        raise DrafterCheckError(
            f"{e}; the config and weights come from different drafters"
        ) from None


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
