"""What a drafter's sizing needs to know of its target (hf_target/info.py reads it from a
checkpoint's config; drafters/presets.py sizes drafters from it)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_moa.model.config import TargetShape


@dataclass(frozen=True)
class TargetInfo:
    """Target facts a preset needs beyond the shape."""

    shape: TargetShape
    num_attention_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
