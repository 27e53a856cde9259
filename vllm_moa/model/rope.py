"""Rotary position embeddings of the drafters' attention blocks (rotate-half convention).

Plain RoPE over a base theta, or a target's RoPE scaling (Llama-3.1's "llama3", "linear",
"yarn"), whose inverse frequencies and cos/sin factor come from transformers' own
`ROPE_INIT_FUNCTIONS`, so a block rotates exactly as the target's `LlamaRotaryEmbedding` does.
A scaling is recorded as the target's `rope_parameters` less the base (`rope_scaling_of`).
Types whose frequencies change with the sequence length ("dynamic", "longrope") are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")
# Keys of a transformers rope_parameters dict that are not the scaling: the base (its own field),
# the legacy spelling of rope_type, and partial rotation (the drafters rotate whole heads).
_NOT_SCALING = frozenset({"rope_theta", "type", "rope_type", "partial_rotary_factor"})
# Types that need the pretraining length; transformers' standardize_rope_params defaults it to
# max_position_embeddings.
_NEED_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., S, D] for integer positions [..., S] (rotate-half convention)."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # [..., S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., S, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def scaled_cos_sin(
    positions: torch.Tensor,  # [..., S] integer
    inv_freq: torch.Tensor,  # [D/2] float32, on positions' device
    factor: float,  # transformers' attention_scaling, applied to cos and sin
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., S, D] from given frequencies, as LlamaRotaryEmbedding.forward computes."""
    freqs = positions.float()[..., None] * inv_freq  # [..., S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., S, D]
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D]; cos/sin: [S, D], or [B, S, D] for per-row positions."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_scaling_of(
    params: Mapping[str, Any] | None, max_positions: int | None = None
) -> dict[str, Any] | None:
    """The scaling a transformers `rope_parameters` (or legacy `rope_scaling`) dict sets, as
    drafter configs record it: {"rope_type": ..., its parameters, sorted}, without the base;
    None for plain RoPE. `max_positions`: the config's max_position_embeddings, the pretraining
    length transformers assumes when a type that needs one does not state it."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    out: dict[str, Any] = {"rope_type": kind}
    out.update({k: params[k] for k in sorted(params) if k not in _NOT_SCALING})
    if kind in _NEED_ORIGINAL_LENGTH and max_positions is not None:
        out.setdefault("original_max_position_embeddings", int(max_positions))
    return out


def config_rope_scaling(config: object) -> dict[str, Any] | None:
    """The RoPE scaling of a Hugging Face (or vLLM) model config object; None for plain RoPE."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return rope_scaling_of(
        params if isinstance(params, Mapping) else None,
        getattr(config, "max_position_embeddings", None),
    )


def scaled_frequencies(
    head_dim: int, theta: float, scaling: Mapping[str, Any], what: str = "rope scaling"
) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim / 2] (float32, on the default device) and the factor transformers
    multiplies cos and sin by, for heads of `head_dim` with base `theta` under `scaling` (as
    `rope_scaling_of` records it): transformers' ROPE_INIT_FUNCTIONS[rope_type] on a Llama
    config carrying them. `what` names the setting in errors (ValueError)."""
    kind = scaling.get("rope_type") if isinstance(scaling, Mapping) else None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"{what} must be a dict with rope_type one of {list(ROPE_SCALING_TYPES)}, got "
            f"{scaling!r} ('dynamic' and 'longrope' change with the sequence length: "
            "not supported)"
        )
    if "rope_theta" in scaling:
        raise ValueError(f"{what} must not hold rope_theta (the base is its own field)")
    if kind in _NEED_ORIGINAL_LENGTH and "original_max_position_embeddings" not in scaling:
        raise ValueError(f"{what} of type {kind!r} must state original_max_position_embeddings")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**scaling, "rope_theta": theta}
    # Not read for the accepted types' frequencies (YaRN only without a factor, which it
    # requires): the extended length, so that transformers' checks against it stay quiet.
    original = scaling.get("original_max_position_embeddings")
    max_positions = int(original * (scaling.get("factor") or 1.0)) if original else 2048
    try:
        config = LlamaConfig(
            hidden_size=head_dim,
            num_attention_heads=1,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rope_parameters=params,
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{what} {dict(scaling)} is not valid for transformers: {e}") from None
    return inv_freq.float(), float(factor)
