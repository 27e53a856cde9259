"""EAGLE-3's configuration: EAGLE's decoder layer (TokenLayerConfig's fields), the target layers
whose inputs it reads, and the size of its own vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from vllm_moa.drafters.token_layers import TokenLayerConfig


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 reads: vLLM's and the authors' (2, L//2, L-3) when
    they are three distinct layers (L >= 8); on shallower targets three (or, L = 3, two)
    distinct layers spread over 1..L-1. Layer 0's input (the embeddings) is never read: vLLM
    captures no state there."""
    if num_layers < 3:
        raise ValueError(
            f"EAGLE-3 reads the inputs of at least two of the target's layers 1..L-1; this target "
            f"has L = {num_layers} layers. Use --method eagle for so shallow a target"
        )
    default = (2, num_layers // 2, num_layers - 3)
    if len(set(default)) == 3 and min(default) >= 1:
        return default
    if num_layers == 3:
        return (1, 2)
    low, high = 1, num_layers - 1
    return (low, (low + high) // 2, high)


@dataclass(frozen=True)
class Eagle3Config(TokenLayerConfig):
    MODEL_TYPE: ClassVar[str] = "eagle3_drafter"
    ARCHITECTURE: ClassVar[str] = "Eagle3Drafter"

    # HF hidden-state indices (the input of layer l), ascending and distinct, 1 <= l < L.
    feature_layers: tuple[int, ...] = field(kw_only=True)
    # The drafter's own LM head's vocabulary: the target's whole vocabulary, or EAGLE-3's
    # reduced draft vocabulary (fewer rows; the drafter then holds the d2t / t2d maps, model.py).
    draft_vocab_size: int = field(kw_only=True)

    @property
    def reduced_vocab(self) -> bool:
        """Whether the LM head covers only part of the target's vocabulary (d2t / t2d held)."""
        return self.draft_vocab_size < self.vocab_size

    def __post_init__(self) -> None:
        layers = self.feature_layers
        if not isinstance(layers, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers
        ):
            raise TypeError(f"Eagle3Config.feature_layers must be a list of ints, got {layers!r}")
        object.__setattr__(self, "feature_layers", tuple(layers))  # JSON gives a list
        super().__post_init__()
        layers = self.feature_layers
        if not layers or list(layers) != sorted(set(layers)):
            raise ValueError(
                f"Eagle3Config.feature_layers must be distinct and ascending, got {list(layers)}"
            )
        if layers[0] < 1 or layers[-1] >= self.target_num_layers:
            raise ValueError(
                f"Eagle3Config.feature_layers {list(layers)} must lie in 1..L-1 = "
                f"1..{self.target_num_layers - 1} (the input of a layer after the first)"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Eagle3Config.draft_vocab_size must lie in 1..{self.vocab_size} (the target's "
                f"vocabulary), got {self.draft_vocab_size}; set it to at most vocab_size"
            )
