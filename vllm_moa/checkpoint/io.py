"""Drafter checkpoints: a Hugging Face style directory with config.json and model.safetensors.

Only the drafter's own weights are stored; embeddings, LM head and TLI layers are the target's.
Loading refuses, in one line naming the file, the defect and the fix, what it cannot load as
written: a missing, unparsable or non-object config.json, a key missing or of the wrong type, an
unknown model_type, a NaN or Inf config number; a missing, truncated or corrupt weights file,
tensors missing, unexpected or of another shape than the config implies, of a dtype other than
float32 / bfloat16 / float16 (never cast: an integer or fp8 tensor means a quantized or foreign
checkpoint; only the integer / bool buffers the drafter itself holds, EAGLE-3's d2t and t2d and
MoA's draft_ids, are stored as such, in exactly their dtype), or holding NaN / Inf.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import vllm_moa
from vllm_moa.kinds import BY_MODEL_TYPE
from vllm_moa.model.config import DrafterConfig, TargetShape

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# The safetensors dtypes a drafter's weights may have (load_drafter casts them to the dtype asked
# for); anything else is refused by name rather than cast.
WEIGHT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
# safetensors' names of the dtypes of a drafter's non-float buffers (EAGLE-3's d2t: int64, t2d:
# bool; MoA's draft_ids: int64), which must be stored in exactly the dtype the drafter holds.
BUFFER_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}
RECREATE = "re-create the drafter (`vllm-moa init-drafter` or `vllm-moa train`)"
NOT_A_DRAFTER_DIR = (
    "pass the drafter/ folder `vllm-moa train --out` wrote, or one made by `vllm-moa init-drafter`"
)


class DrafterCheckError(ValueError):
    """A drafter checkpoint that cannot be used; the message names the file, what is wrong and
    what to do."""


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as its safetensors header records it (no data read)."""

    dtype: str  # safetensors' name: "F32", "BF16", "I64", "F8_E4M3", ...
    shape: tuple[int, ...]


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


# -- config.json ------------------------------------------------------------------------------


def read_config_file(file: Path) -> dict[str, Any]:
    """The JSON object in a drafter's config.json (FileNotFoundError if there is none)."""
    if not file.is_file():
        raise FileNotFoundError(
            f"no drafter config at {file}: {file.parent} is not a drafter directory; "
            + NOT_A_DRAFTER_DIR
        )
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DrafterCheckError(
            f"{file} is not valid JSON ({e}): truncated or damaged; copy it again or " + RECREATE
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DrafterCheckError(f"cannot read {file} as text ({e}); copy it again") from None
    if not isinstance(data, dict):
        raise DrafterCheckError(
            f"{file} holds a JSON {type(data).__name__}, not an object: not a drafter config; "
            + NOT_A_DRAFTER_DIR
        )
    return data


def _non_finite(value: Any, where: str) -> list[str]:
    """The keys (dotted) of the NaN / Infinity numbers in `value` (JSON parses both)."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [where]
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in _non_finite(v, f"{where}.{key}")]
    return []


def config_from_data(data: dict[str, Any], file: Path) -> DrafterConfig:
    """The config of the kind `data`'s model_type names (the registry's), checked."""
    model_type = data.get("model_type")
    kind = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if kind is None:
        raise DrafterCheckError(
            f"{file.parent} is not a vllm-moa drafter: its {CONFIG_NAME} has model_type "
            f"{model_type!r} (a model, not a drafter?), expected one of {sorted(BY_MODEL_TYPE)}. "
            "Pass the drafter's directory; for the authors' MoA release run "
            "`vllm-moa convert-official` first"
        )
    try:
        config: DrafterConfig = kind.load("config").from_dict(data)
    except (TypeError, ValueError) as e:
        raise DrafterCheckError(f"{file}: {e}; correct it there or {RECREATE}") from None
    fields = dataclasses.asdict(config)
    bad = [k for name, v in fields.items() for k in _non_finite(v, name)]
    if bad:
        raise DrafterCheckError(
            f"{file}: {', '.join(bad)} must be a finite number, got NaN or Infinity; correct it "
            f"there or {RECREATE}"
        )
    return config


def load_config(path: str | Path) -> DrafterConfig:
    """The drafter config in a directory, of the kind its model_type names."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"drafter directory {path} does not exist")
    if not path.is_dir():
        raise DrafterCheckError(f"drafter path {path} is not a directory; " + NOT_A_DRAFTER_DIR)
    file = path / CONFIG_NAME
    return config_from_data(read_config_file(file), file)


def check_target(config: DrafterConfig, target: TargetShape, path: Path) -> None:
    """Raise if the drafter at `path` was built for a target of another shape."""
    try:
        config.check_target(target)
    except ValueError as e:
        raise DrafterCheckError(f"drafter {path}: {e}") from None


# -- model.safetensors ------------------------------------------------------------------------


def _unreadable(file: Path, e: Exception) -> DrafterCheckError:
    return DrafterCheckError(
        f"{file} is truncated or not a safetensors file ({e}): a corrupt or incomplete copy; "
        "copy it again or re-save the drafter"
    )


def read_header(file: Path) -> dict[str, TensorHeader]:
    """Every tensor's dtype and shape, from the header of the weights file `file` alone
    (FileNotFoundError if there is none). safetensors checks there that the data spans the
    file exactly, so a truncated file is refused here."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise FileNotFoundError(
            f"{file.parent} has no {file.name}; the drafter's weights are missing (an "
            "interrupted copy or training run?): copy them again or re-run `vllm-moa train`"
        )
    try:
        with safe_open(str(file), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
            return {n: TensorHeader(s.get_dtype(), tuple(s.get_shape())) for n, s in slices.items()}
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from None


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


def buffer_dtypes(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> safetensors dtype of the tensors of a drafter's state that are not floating point
    (index maps such as EAGLE-3's d2t / t2d, MoA's draft_ids): check_header's `exact`."""
    return {n: BUFFER_DTYPES[t.dtype] for n, t in state.items() if not t.is_floating_point()}


def check_header(
    header: dict[str, TensorHeader],
    expected: dict[str, tuple[int, ...]],
    file: Path,
    exact: dict[str, str] | None = None,
) -> None:
    """The tensors a drafter's weights file must hold: the names and shapes `expected` (its
    config's), each of a dtype in WEIGHT_DTYPES except those `exact` names (the drafter's
    integer / bool buffers, `buffer_dtypes`), each of exactly its dtype."""
    try:
        check_tensors(expected, {name: h.shape for name, h in header.items()}, str(file))
    except ValueError as e:
        raise DrafterCheckError(
            f"{e}; the config and weights come from different drafters: copy the directory "
            "again or re-save the drafter"
        ) from None
    exact = exact or {}
    off = {
        n: (h.dtype, exact[n])
        for n, h in sorted(header.items())
        if h.dtype != exact.get(n, h.dtype)
    }
    if off:
        named = ", ".join(f"{name} ({got}, expected {want})" for name, (got, want) in off.items())
        raise DrafterCheckError(
            f"{file}: {named}: the drafter's index buffers (the draft vocabulary's: EAGLE-3's d2t "
            "int64 and t2d bool, MoA's draft_ids int64) are stored in exactly their dtype, never "
            "cast; a checkpoint whose maps were saved as floats or another integer type is "
            "foreign or damaged: re-save the drafter (`vllm-moa train --draft-vocab`)"
        )
    wrong = {
        name: h.dtype
        for name, h in sorted(header.items())
        if name not in exact and h.dtype not in WEIGHT_DTYPES
    }
    if wrong:
        named = ", ".join(f"{name} ({dtype})" for name, dtype in list(wrong.items())[:3])
        raise DrafterCheckError(
            f"{file}: {len(wrong)} of {len(header)} tensors are not {' / '.join(WEIGHT_DTYPES)}: "
            f"{named}{', ...' if len(wrong) > 3 else ''}; a drafter's weights are floating point "
            "(integer or fp8 tensors: a quantized or foreign checkpoint, which is not cast): "
            "re-save the drafter in float32, bfloat16 or float16"
        )


def check_finite(state: dict[str, torch.Tensor], file: Path) -> None:
    """Refuse NaN / Inf weights, naming the first tensors and their counts (one isfinite pass
    per tensor of the loaded copy)."""
    bad = [name for name, t in sorted(state.items()) if not bool(torch.isfinite(t).all())]
    if bad:
        counts = [
            f"{n} ({int((~torch.isfinite(state[n])).sum())} of {state[n].numel()} values)"
            for n in bad[:3]
        ]
        raise DrafterCheckError(
            f"{file}: {len(bad)} of {len(state)} tensors hold NaN or Inf: {', '.join(counts)}"
            f"{', ...' if len(bad) > 3 else ''}; the training run diverged or the file is "
            "damaged: use an earlier checkpoint, copy it again, or re-train (a lower learning rate)"
        )


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"no weights file {path}")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise _unreadable(path, e) from None


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
    """Load a drafter directory; with `target`, check it was built for that target's shape.
    Raises DrafterCheckError (FileNotFoundError for a missing directory or file)."""
    path = Path(path)
    config = load_config(path)
    if target is not None:
        check_target(config, target, path)
    drafter: nn.Module = BY_MODEL_TYPE[config.MODEL_TYPE].load("module")(config)
    file = path / WEIGHTS_NAME
    own = drafter.state_dict()
    shapes = {name: tuple(t.shape) for name, t in own.items()}
    check_header(read_header(file), shapes, file, buffer_dtypes(own))
    state = load_state_dict(file)
    check_finite(state, file)
    drafter.load_state_dict(state)
    if dtype is not None:
        drafter = drafter.to(dtype)
    return drafter.to(device).eval()
