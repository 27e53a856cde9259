"""EAGLE's configuration: one decoder layer at the target's width (TokenLayerConfig's fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_moa.drafters.token_layers import TokenLayerConfig


@dataclass(frozen=True)
class EagleConfig(TokenLayerConfig):
    MODEL_TYPE: ClassVar[str] = "eagle_drafter"
    ARCHITECTURE: ClassVar[str] = "EagleDrafter"
