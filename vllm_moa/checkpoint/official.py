"""Import the authors' released MoA checkpoint layout (huawei-noah/HEBO, mixture-of-attentions).

That layout is a target-style config.json (Llama fields: hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, vocab_size, rope_theta, rms_norm_eps) and
safetensors files whose keys start with `self_attention.`, `cross_attention.`,
`layer_self_attention.`, `Ekv2E.`; below those prefixes the keys follow Hugging Face's Llama
decoder layer (`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`). Copies of the target's `embed_tokens`/`lm_head` are dropped.

Head counts are not stored as tensors: they are derived from the projection shapes and a head
size (the target's head_dim for SA/CA, 64 for LSA as in the release), which can be overridden.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_moa.checkpoint.io import load_checked, load_state_dict, save_drafter
from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.model.config import TargetShape

BLOCKS = ("layer_self_attention", "self_attention", "cross_attention")
_SHARED_TARGET_KEYS = ("embed_tokens.", "lm_head.", "model.embed_tokens.")
# Attention submodule spellings seen for the cross-attention block, mapped to ours.
_ATTN_ALIASES = {
    ".cross_attn.": ".self_attn.",
    ".attn.": ".self_attn.",
    ".attention.": ".self_attn.",
}


@dataclass(frozen=True)
class ConvertOptions:
    tli: int | None = None  # None: read from config.json ("tli"), else 0
    lsa_head_dim: int = 64
    head_dim: int | None = None  # SA/CA head size; None: the target's head_dim
    target: TargetShape | None = None  # None: read the target shape from SRC's config.json


def _read_official_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{src} has no config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in data:
            raise ValueError(f"{path} lacks {key!r}: not a target-style (Llama) config")
    return data


def _read_official_weights(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_state_dict(f))
    return state


def _rename(key: str) -> str | None:
    """Official key -> our key; None to drop (shared target weights)."""
    if key.startswith("model.") and key.split(".", 2)[1] in (*BLOCKS, "Ekv2E"):
        key = key[len("model.") :]
    if key.startswith(_SHARED_TARGET_KEYS):
        return None
    if key.startswith("cross_attention."):
        for alias, ours in _ATTN_ALIASES.items():
            key = key.replace(alias, ours)
    return key


def _block_dims(state: dict[str, torch.Tensor], block: str, head_dim: int) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, intermediate_size) of a block, from its tensor shapes."""
    try:
        q = state[f"{block}.self_attn.q_proj.weight"].shape[0]
        k = state[f"{block}.self_attn.k_proj.weight"].shape[0]
        mlp = state[f"{block}.mlp.gate_proj.weight"].shape[0]
    except KeyError as e:
        raise ValueError(f"official checkpoint lacks {e.args[0]}") from None
    if q % head_dim or k % head_dim:
        raise ValueError(
            f"{block}: projections of {q} (q) and {k} (k) outputs are not multiples of head size "
            f"{head_dim}; pass the right head size (--head-dim / --lsa-head-dim)"
        )
    return q // head_dim, k // head_dim, mlp


def _target_from_config(cfg: dict[str, Any]) -> TargetShape:
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return TargetShape(
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
    )


def convert_official(
    src: str | Path, dst: str | Path, options: ConvertOptions | None = None
) -> Path:
    """Convert an official MoA checkpoint directory into a vllm-moa drafter directory."""
    opts = options or ConvertOptions()
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint directory {src} does not exist")
    cfg = _read_official_config(src)
    raw = _read_official_weights(src)
    state = {new: t for k, t in raw.items() if (new := _rename(k)) is not None}

    target = opts.target or _target_from_config(cfg)
    if "Ekv2E.weight" not in state:
        raise ValueError("official checkpoint lacks Ekv2E.weight")
    width = state["Ekv2E.weight"].shape[1]
    if width != 2 * target.kv_width:
        raise ValueError(
            f"Ekv2E takes {width} inputs but the target's 2*E_kv is {2 * target.kv_width}; pass "
            "--target with the real target directory"
        )
    head_dim = opts.head_dim or target.head_dim
    lsa = _block_dims(state, "layer_self_attention", opts.lsa_head_dim)
    sa = _block_dims(state, "self_attention", head_dim)
    ca = _block_dims(state, "cross_attention", head_dim)
    tli = opts.tli if opts.tli is not None else int(cfg.get("tli", 0))
    config = MoAConfig(
        **MoAConfig.target_fields(target),
        lsa_num_heads=lsa[0],
        lsa_num_kv_heads=lsa[1],
        lsa_intermediate_size=lsa[2],
        sa_num_heads=sa[0],
        sa_num_kv_heads=sa[1],
        sa_intermediate_size=sa[2],
        ca_num_heads=ca[0],
        ca_num_kv_heads=ca[1],
        ca_intermediate_size=ca[2],
        tli=tli,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
    )
    drafter = MoADrafter(config)
    load_checked(drafter, state, f"official checkpoint {src} (head counts derived from shapes)")
    dtype = next(iter(state.values())).dtype
    return save_drafter(drafter.to(dtype), dst)
