"""Size a MoA drafter for a given target.

`paper` keeps the release's ratios for Llama-3-8B (E=4096, 32 heads, 8 KV heads, d=128):
LSA width 2*E_kv=2048 with head size 64 (32 heads, 8 KV heads) and MLP 1.5x width (3072);
SA and CA with the target's head count, half its KV heads and MLP 1.5x E (6144). That gives
about 264M trainable parameters at 8B. `small` halves the MLPs and KV heads for quick runs.
"""

from __future__ import annotations

from typing import Any

from vllm_moa.drafters.eagle.config import EagleConfig
from vllm_moa.drafters.eagle3.config import Eagle3Config, default_feature_layers
from vllm_moa.drafters.griffin.config import GriffinConfig
from vllm_moa.drafters.independent.config import IndependentConfig
from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.model.config import DrafterConfig
from vllm_moa.model.target_info import TargetInfo

PRESETS = ("paper", "small")


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, limit) + 1) if n % d == 0)


def _heads_for(width: int, head_size: int) -> int:
    """A head count giving heads of about `head_size` with an even head size."""
    heads = _largest_divisor_at_most(width, max(1, width // head_size))
    while (width // heads) % 2:
        heads = _largest_divisor_at_most(width, heads - 1)
    return heads


def _kv_heads(heads: int, wanted: int) -> int:
    return _largest_divisor_at_most(heads, max(1, wanted))


def _token_heads(target: TargetInfo) -> int:
    """The target's head count if it splits E into even heads, else heads of ~head_dim."""
    heads, width = target.num_attention_heads, target.shape.hidden_size
    if width % heads or (width // heads) % 2:
        return _heads_for(width, target.shape.head_dim)
    return heads


def make_config(
    target: TargetInfo,
    preset: str = "paper",
    tli: int = 0,
    memory_source: str = "lsa",
    draft_vocab: int | None = None,
) -> MoAConfig:
    """`draft_vocab`: drafts over that many tokens (MoA's draft vocabulary, `train
    --draft-vocab`; the target's LM-head rows of the data's most frequent tokens), None: all."""
    _check_preset(preset)
    s = target.shape
    width = 2 * s.kv_width
    lsa_heads = _heads_for(width, 64)
    tok_heads = _token_heads(target)
    if preset == "paper":
        lsa_kv, tok_kv = lsa_heads // 4, s.num_kv_heads // 2
        lsa_mlp, tok_mlp = width * 3 // 2, s.hidden_size * 3 // 2
    else:
        lsa_kv, tok_kv = lsa_heads // 8, s.num_kv_heads // 4
        lsa_mlp, tok_mlp = width * 3 // 4, s.hidden_size * 3 // 4
    return MoAConfig(
        **DrafterConfig.target_fields(s),
        lsa_num_heads=lsa_heads,
        lsa_num_kv_heads=_kv_heads(lsa_heads, lsa_kv),
        lsa_intermediate_size=max(8, lsa_mlp),
        sa_num_heads=tok_heads,
        sa_num_kv_heads=_kv_heads(tok_heads, tok_kv),
        sa_intermediate_size=max(8, tok_mlp),
        ca_num_heads=tok_heads,
        ca_num_kv_heads=_kv_heads(tok_heads, tok_kv),
        ca_intermediate_size=max(8, tok_mlp),
        tli=tli,
        rope_theta=target.rope_theta,
        lsa_rope_theta=10000.0,
        sa_rope_scaling=s.rope_scaling,
        rms_norm_eps=target.rms_norm_eps,
        memory_source=memory_source,
        draft_vocab_size=_draft_vocab(target, draft_vocab),
    )


def _token_layer_fields(target: TargetInfo, kv_divisor: int, mlp: int) -> dict[str, Any]:
    """Constructor arguments shared by the baselines' layers at the target's width."""
    heads = _token_heads(target)
    return {
        **DrafterConfig.target_fields(target.shape),
        "num_heads": heads,
        "num_kv_heads": _kv_heads(heads, target.shape.num_kv_heads // kv_divisor),
        "intermediate_size": max(8, mlp),
        "rope_theta": target.rope_theta,
        "rope_scaling": target.shape.rope_scaling,
        "rms_norm_eps": target.rms_norm_eps,
    }


def _check_preset(preset: str) -> bool:
    """True for `small`; raises on an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    return preset == "small"


def _eagle_fields(target: TargetInfo, preset: str) -> dict[str, Any]:
    small, e = _check_preset(preset), target.shape.hidden_size
    return _token_layer_fields(target, 4 if small else 1, e * (3 if small else 7) // 2)


def make_eagle_config(target: TargetInfo, preset: str = "paper") -> EagleConfig:
    """One decoder layer at the target's width (EAGLE); `small` shrinks the MLP and KV heads."""
    return EagleConfig(**_eagle_fields(target, preset))


def make_griffin_config(target: TargetInfo, preset: str = "paper") -> GriffinConfig:
    """EAGLE's layer of the same preset, TGF's MLP as wide as that layer's: the paper sets it to
    the target's FFN width, which is what the `paper` preset gives EAGLE's layer (3.5 E, Llama-3's
    14336 at E = 4096)."""
    fields = _eagle_fields(target, preset)
    return GriffinConfig(**fields, tgf_intermediate_size=fields["intermediate_size"])


def make_eagle3_config(
    target: TargetInfo, preset: str = "paper", draft_vocab: int | None = None
) -> Eagle3Config:
    """EAGLE's layer of the same preset (its attention reading 2E), fc over the inputs of the
    target layers `default_feature_layers` picks, and an LM head over the whole vocabulary, or
    over `draft_vocab` tokens (EAGLE-3's reduced draft vocabulary, `train --draft-vocab`)."""
    fields = _eagle_fields(target, preset)
    vocab = _draft_vocab(target, draft_vocab)
    return Eagle3Config(
        **fields,
        feature_layers=default_feature_layers(target.shape.num_layers),
        draft_vocab_size=target.shape.vocab_size if vocab is None else vocab,
    )


def _draft_vocab(target: TargetInfo, draft_vocab: int | None) -> int | None:
    """`train --draft-vocab`'s value, checked against the target's vocabulary."""
    vocab = target.shape.vocab_size
    if draft_vocab is not None and not 1 <= draft_vocab <= vocab:
        raise ValueError(
            f"--draft-vocab must lie in 1..{vocab} (the target's vocabulary), got {draft_vocab}"
        )
    return draft_vocab


def make_independent_config(
    target: TargetInfo, preset: str = "paper", num_layers: int = 2
) -> IndependentConfig:
    """A `num_layers`-layer LM at the target's width sharing its embeddings and LM head."""
    small, e = _check_preset(preset), target.shape.hidden_size
    fields = _token_layer_fields(target, 4 if small else 2, e * 3 // (4 if small else 2))
    return IndependentConfig(**fields, num_layers=num_layers)
