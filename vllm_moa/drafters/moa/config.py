"""The MoA drafter's configuration: every architecture knob plus the target shape it is for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_moa.model.config import DrafterConfig, TargetShape
from vllm_moa.model.rope import scaled_frequencies

MOA_ARCHITECTURE = "MoADrafter"
MOA_MODEL_TYPE = "moa_drafter"
MEMORY_SOURCES = ("lsa", "hidden")


@dataclass(frozen=True)
class MoAConfig(DrafterConfig):
    """Architecture of a Mixture of Attentions drafter (see docs: MOA_SPEC.md).

    LSA runs over the layer axis with width 2 * E_kv; SA and CA run over tokens with width E.
    Head sizes are derived: width / num_heads.
    """

    MODEL_TYPE: ClassVar[str] = MOA_MODEL_TYPE
    ARCHITECTURE: ClassVar[str] = MOA_ARCHITECTURE
    ROPE_SCALING_MESSAGE: ClassVar[tuple[str, str, str]] = (
        "Self-Attention",
        "sa_rope_scaling",
        "`vllm-moa init-drafter --target ...`, `vllm-moa train`, or "
        "`vllm-moa convert-official --target ...`",
    )

    # Layer Self-Attention (over the L axis, width 2 * E_kv).
    lsa_num_heads: int
    lsa_num_kv_heads: int
    lsa_intermediate_size: int
    # Self-Attention (causal, over the target's token embeddings).
    sa_num_heads: int
    sa_num_kv_heads: int
    sa_intermediate_size: int
    # Cross-Attention (queries from SA, keys/values from the LSA memory).
    ca_num_heads: int
    ca_num_kv_heads: int
    ca_intermediate_size: int
    # Target Layer Inference: how many of the target's last layers finish the draft.
    tli: int = 0
    rope_theta: float = 10000.0  # SA and CA, over token positions
    lsa_rope_theta: float = 10000.0  # LSA, over the layer index
    # The target's RoPE scaling, applied in SA only (as the authors' training code does; CA and
    # LSA stay plain): model/rope.py's rope_scaling_of form, e.g. {"rope_type": "llama3",
    # "factor": 8.0, ...}. None: plain RoPE (every drafter made before this field existed).
    sa_rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    # LSA's norms' eps when it differs from SA/CA's (`vllm-moa inflate` widens SA/CA, not LSA);
    # 0: the same as rms_norm_eps.
    lsa_rms_norm_eps: float = 0.0
    # "lsa": memory rows come from LSA over every layer's K|V (MoA). "hidden": the CA reads the
    # target's final hidden states instead (the paper's "-LSA, o_1..o_t inputs" ablation).
    memory_source: str = "lsa"
    # The draft vocabulary (`vllm-moa train --draft-vocab N`): drafts are only ever these N
    # target tokens, whose ids the drafter holds (MoADrafter.draft_ids), and a draft step reads
    # only their rows of the target's LM head. None (or vocab_size): the whole vocabulary;
    # written to config.json only when set, so drafters made before it load unchanged.
    draft_vocab_size: int | None = None

    @property
    def reduced_vocab(self) -> bool:
        """Whether drafts are restricted to part of the target's vocabulary (draft_ids held)."""
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.draft_vocab_size is None:
            del out["draft_vocab_size"]
        return out

    def __post_init__(self) -> None:
        if self.memory_source not in MEMORY_SOURCES:
            raise ValueError(
                f"MoAConfig.memory_source must be one of {list(MEMORY_SOURCES)}, "
                f"got {self.memory_source!r}"
            )
        self._check_numbers(allow_zero=("tli", "lsa_rms_norm_eps"))
        if not 0 <= self.tli < self.target_num_layers:
            raise ValueError(
                f"MoAConfig.tli must satisfy 0 <= tli < target_num_layers "
                f"({self.target_num_layers}), got {self.tli}"
            )
        self._check_heads("lsa_", self.lsa_width, self.lsa_num_heads, self.lsa_num_kv_heads)
        self._check_heads("sa_", self.target_hidden_size, self.sa_num_heads, self.sa_num_kv_heads)
        self._check_heads("ca_", self.target_hidden_size, self.ca_num_heads, self.ca_num_kv_heads)
        n = self.draft_vocab_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
            raise TypeError(f"MoAConfig.draft_vocab_size must be an int or null, got {n!r}")
        if n is not None and not 1 <= n <= self.vocab_size:
            raise ValueError(
                f"MoAConfig.draft_vocab_size must lie in 1..{self.vocab_size} (the target's "
                f"vocabulary), got {n}; set it to at most vocab_size, or null for the whole one"
            )
        if self.sa_rope_scaling is not None:  # transformers validates the parameters
            sa_head = self.target_hidden_size // self.sa_num_heads
            scaled_frequencies(sa_head, self.rope_theta, self.sa_rope_scaling, "sa_rope_scaling")

    @property
    def target_shape(self) -> TargetShape:
        return dataclasses.replace(super().target_shape, rope_scaling=self.sa_rope_scaling)

    @property
    def lsa_width(self) -> int:
        """2 * E_kv: one token's K|V for one target layer."""
        return 2 * self.target_num_kv_heads * self.target_head_dim
