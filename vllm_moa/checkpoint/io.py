"""Drafter checkpoints: a Hugging Face style directory with config.json and model.safetensors.

Only the drafter's own weights are stored; embeddings, LM head and TLI layers are the target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import vllm_moa
from vllm_moa.kinds import BY_MODEL_TYPE
from vllm_moa.model.config import DrafterConfig, TargetShape, read_config_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def save_drafter(
    drafter: nn.Module, out_dir: str | Path, training: dict[str, Any] | None = None
) -> Path:
    """Write config.json (drafter.config; `training`: facts of its training recorded there, e.g.
    the chain lengths it learned) and model.safetensors (the drafter's own weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drafter_config: DrafterConfig = getattr(drafter, "config")  # noqa: B009 (typed access)
    config = drafter_config.to_dict()
    config["vllm_moa_version"] = vllm_moa.__version__
    if training:
        config["training"] = training
    config["torch_dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def drafter_dir_of(path: str | Path) -> Path:
    """`path`, or its drafter/ folder when `path` is a `vllm-moa train --out` directory."""
    base = Path(path).expanduser()
    if not (base / CONFIG_NAME).is_file() and (base / "drafter" / CONFIG_NAME).is_file():
        return base / "drafter"
    return base


def load_config(path: str | Path) -> DrafterConfig:
    """The drafter config in a directory, of the kind its model_type names."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"drafter directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"drafter path {path} is not a directory")
    data = read_config_json(path / CONFIG_NAME)
    kind = BY_MODEL_TYPE.get(str(data.get("model_type")))
    if kind is None:
        raise ValueError(
            f"{path / CONFIG_NAME} has model_type {data.get('model_type')!r}; expected one of "
            f"{sorted(BY_MODEL_TYPE)} (for the authors' MoA release: `vllm-moa convert-official`)"
        )
    config: DrafterConfig = kind.load("config").from_dict(data)
    return config


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"no weights file {path}")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise ValueError(f"cannot read {path}: corrupt or not a safetensors file ({e})") from None


def check_tensors(
    expected: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]], source: str
) -> None:
    """Raise naming missing / unexpected tensor names and wrong shapes of `source`."""
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match its config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, shape in stored.items():
        if shape != expected[name]:
            raise ValueError(f"{source}: {name} has shape {shape}, config implies {expected[name]}")


def load_checked(drafter: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state` into `drafter`, naming missing/unexpected keys and wrong shapes."""
    shapes = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    check_tensors(shapes, {name: tuple(t.shape) for name, t in state.items()}, source)
    drafter.load_state_dict(state)


def load_drafter(
    path: str | Path,
    target: TargetShape | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Load a drafter directory; with `target`, check it was built for that target's shape."""
    path = Path(path)
    config = load_config(path)
    if target is not None:
        config.check_target(target)
    drafter: nn.Module = BY_MODEL_TYPE[config.MODEL_TYPE].load("module")(config)
    load_checked(drafter, load_state_dict(path / WEIGHTS_NAME), str(path / WEIGHTS_NAME))
    if dtype is not None:
        drafter = drafter.to(dtype)
    return drafter.to(device).eval()
