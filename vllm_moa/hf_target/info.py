"""Read a target's shape from its config.json without loading weights."""

from __future__ import annotations

from pathlib import Path

from vllm_moa.hf_target.adapter import SUPPORTED_MODEL_TYPES, target_shape
from vllm_moa.model.target_info import TargetInfo


def rope_theta_of(config: object) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def load_target_info(path: str | Path) -> TargetInfo:
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target directory {path} has no config.json")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the target config in {path}: {e}") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"target model_type {config.model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return TargetInfo(
        shape=target_shape(config),
        num_attention_heads=config.num_attention_heads,
        rope_theta=rope_theta_of(config),
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
    )
