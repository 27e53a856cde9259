"""GRIFFIN's configuration: EAGLE's decoder layer (TokenLayerConfig's fields) plus the width of
Token-Guided Fusion's MLP."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from vllm_moa.drafters.token_layers import TokenLayerConfig


@dataclass(frozen=True)
class GriffinConfig(TokenLayerConfig):
    MODEL_TYPE: ClassVar[str] = "griffin_drafter"
    ARCHITECTURE: ClassVar[str] = "GriffinDrafter"

    # TGF's expansion (the paper's W_u: 2E -> this, W_d: this -> E); the paper sets it to the
    # target's FFN width (its appendix A.3), as the `paper` preset does.
    tgf_intermediate_size: int = field(kw_only=True)
