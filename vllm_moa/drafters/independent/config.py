"""The independent drafter's configuration: `num_layers` decoder layers at the target's width."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_moa.drafters.token_layers import TokenLayerConfig


@dataclass(frozen=True)
class IndependentConfig(TokenLayerConfig):
    MODEL_TYPE: ClassVar[str] = "independent_drafter"
    ARCHITECTURE: ClassVar[str] = "IndependentDrafter"

    num_layers: int = 2
