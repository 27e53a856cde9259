"""Reading a published drafter's files (the MoA authors' release: official.py; the EAGLE-3
authors': official_eagle3.py) without trusting them: config.json as a JSON object of integer
sizes and finite numbers, weights (safetensors, or a PyTorch pickle read as tensors only) of
floating point without NaN / Inf. Every refusal is one ValueError naming the file, the defect
and the fix."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from vllm_moa.model.rope import rope_scaling_of, scaled_frequencies

AGAIN = "copy or download the release again"
# The dtypes a release's weights may have (a converted drafter keeps them); others are refused.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or a ValueError naming the file and the defect."""
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): truncated or damaged; {AGAIN}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path} as text ({e}): damaged; {AGAIN}") from None
    if not isinstance(cfg, dict):
        raise ValueError(
            f"{path} holds a JSON {type(cfg).__name__}, not an object: not a release's "
            "config.json; pass the directory of the authors' release (MoA or EAGLE-3)"
        )
    return cfg


def whole(value: Any, key: str, path: Path) -> int:
    """`value`, the integer config.json gives `key`, or a ValueError naming both."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{path}: {key} must be an integer, got {value!r}; correct it there or {AGAIN}"
        )
    return value


def positive(value: Any, key: str, path: Path) -> int:
    """`value`, the size or count config.json gives `key` (an integer > 0)."""
    value = whole(value, key, path)
    if value <= 0:
        raise ValueError(
            f"{path}: {key} must be positive, got {value}; correct it there or {AGAIN}"
        )
    return value


def finite(value: Any, key: str, path: Path) -> float:
    """`value`, the finite number config.json gives `key`, or a ValueError naming both."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"{path}: {key} must be a finite number, got {value!r}; correct it there or {AGAIN}"
        )
    return float(value)


def rope_scaling_in(
    cfg: dict[str, Any], path: Path, head_dim: int, theta: float
) -> dict[str, Any] | None:
    """The RoPE scaling config.json sets (`rope_scaling`, transformers 4's spelling, or
    `rope_parameters`, transformers 5's), as rope_scaling_of records it, checked as a drafter
    will apply it; None for plain RoPE."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    scaling = rope_scaling_of(
        params if isinstance(params, dict) else None, cfg.get("max_position_embeddings")
    )
    if scaling is not None:
        scaled_frequencies(head_dim, theta, scaling, f"{path}'s RoPE scaling")
    return scaling


def check_against_target(path: Path, checks: list[tuple[str, Any, Any]]) -> None:
    """Each (what, the release's, the target's) must agree, else one line naming the fix."""
    for what, theirs, ours in checks:
        if theirs != ours:
            raise ValueError(
                f"{path} has {what} {theirs} but the target has {ours}: pass --target "
                "with the model the release was trained for"
            )


def check_float_weights(state: dict[str, torch.Tensor], file: Path) -> None:
    """Refuse tensors a converted drafter could not use as written: not floating point (never
    cast) or holding NaN / Inf (the converted drafter would not load), naming the first three."""
    other = [n for n, t in sorted(state.items()) if t.dtype not in FLOAT_DTYPES]
    if other:
        named = ", ".join(f"{n} ({str(state[n].dtype).removeprefix('torch.')})" for n in other[:3])
        raise ValueError(
            f"{file}: {len(other)} of {len(state)} tensors are not float32 / bfloat16 / float16 / "
            f"float64: {named}{', ...' if len(other) > 3 else ''}; the authors' releases are "
            "floating point (an integer or fp8 tensor: a quantized or foreign checkpoint, which is "
            "not cast): pass the release as published"
        )
    bad = [n for n, t in sorted(state.items()) if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(
            f"{file}: {len(bad)} of {len(state)} tensors hold NaN or Inf: {', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}; a damaged copy: {AGAIN}"
        )


def weight_files(src: Path) -> list[Path]:
    """A release's weights files: its *.safetensors (one file or shards), else its
    pytorch_model*.bin (the EAGLE-3 authors' uploads); safetensors first, as vLLM reads them."""
    return sorted(src.glob("*.safetensors")) or sorted(src.glob("pytorch_model*.bin"))


def load_weights_file(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weights file, safetensors or a PyTorch pickle (read with
    weights_only=True: tensors only, no code), or a ValueError naming the file."""
    from safetensors.torch import load_file

    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors' and pickle's own error types for damaged files
        raise ValueError(
            f"{file} is truncated or not a {file.suffix} weights file ({type(e).__name__}: {e}): "
            f"a damaged copy; {AGAIN}"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(
            f"{file} holds a {type(state).__name__}, not a flat name -> tensor dict (a training "
            f"checkpoint with optimizer state?): pass the release's weights as published"
        )
    return state
