"""Import the MoA authors' released drafters (huawei-noah/HEBO, branch mixture-of-attentions,
commit eb554aa; docs/official_checkpoints.md).

Two layouts, both read here; the tensors are the same in both (keys `layer_self_attention.*`,
`Ekv2E.*`, `self_attention.*`, `cross_attention.*` over Llama decoder-layer sub-names):
- "training": what their trainer's `save_pretrained` writes: the TARGET's config.json (a Llama
  config, `architectures: ["MOASpec"]`) beside the drafter's tensors;
- "moa_spec": that directory after their `vllm/convert_checkpoint.py`, the published
  checkpoint's layout: `model_type: "moa_spec"`, per-block KV heads and MLP sizes,
  `kv_hidden_size` = 2*E_kv; the target's `num_hidden_layers` and `num_key_value_heads` deleted.

Geometry, as their classes build it: SA and CA have width E and the target's H query heads of
size E/H; LSA has width 2*E_kv and H heads of size 2*E_kv/H; every block's KV heads and MLP
width come from the tensor shapes; RoPE uses the target's rope_theta in all three blocks (LSA
over the layer index) and the target's RoPE scaling in SA only, as their training code builds it
(their vLLM fork scales all three; docs/official_checkpoints.md). Neither layout records TLI
(--tli), and the moa_spec layout not the target's layer count (--target). Refused, with one line
naming the fact: attention biases (Qwen2 releases), `disable_LSA`, RoPE scaling whose frequencies
change with the sequence length, and a release that contradicts the target; and, naming the file,
a damaged release: a config.json that is not a JSON object or holds a size that is not an
integer or a NaN / Inf number, tensors that are not floating point (never cast: an integer or fp8
tensor means a quantized or foreign checkpoint) or that hold NaN / Inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_moa.checkpoint.io import load_checked, load_state_dict, save_drafter
from vllm_moa.checkpoint.release_files import (
    check_against_target,
    check_float_weights,
    finite,
    positive,
    read_json_object,
    rope_scaling_in,
    whole,
)
from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.model.config import TargetShape
from vllm_moa.model.target_info import TargetInfo

BLOCKS = ("layer_self_attention", "self_attention", "cross_attention")
TRAINING, MOA_SPEC = "training", "moa_spec"
_SHARED_TARGET_KEYS = ("embed_tokens.", "lm_head.", "model.embed_tokens.")
# Attention submodule spellings seen for the cross-attention block, mapped to ours.
_ATTN_ALIASES = {
    ".cross_attn.": ".self_attn.",
    ".attn.": ".self_attn.",
    ".attention.": ".self_attn.",
}
# The moa_spec layout's per-block fields: f"{block}{suffix}".
_SIZES = ("_num_key_value_heads", "_intermediate_size")
# config.json keys recording TLI (neither release layout writes one; ours and their argument's).
_TLI_KEYS = ("tli", "target_layer_inference")


@dataclass(frozen=True)
class ConvertOptions:
    # MoA's TLI; None: the release's own record (config.json "tli"), else refused. EAGLE-3: None.
    tli: int | None = None
    target: TargetInfo | None = None  # the target (--target); moa_spec and EAGLE-3 need it


@dataclass(frozen=True)
class ReleaseConfig:
    """What a release's config.json says, in either layout."""

    path: Path  # the config.json, for messages
    layout: str  # TRAINING or MOA_SPEC
    hidden_size: int  # E
    num_heads: int  # H: the target's query heads, also every drafter block's
    head_dim: int  # the target's head size d
    kv_width: int  # E_kv = n_kv * d
    vocab_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # the target's, as rope_scaling_of records it
    rms_norm_eps: float
    num_layers: int | None  # L; None in the moa_spec layout
    tli: int | None  # None: not recorded
    stated: dict[str, int] = field(default_factory=dict)  # moa_spec: block sizes it states


def _int(cfg: dict[str, Any], key: str, path: Path, layout: str) -> int:
    if key not in cfg:
        raise ValueError(f"{path} ({layout} layout) lacks {key!r}")
    return positive(cfg[key], key, path)


def _rope_theta(cfg: dict[str, Any], path: Path) -> float:
    """The target's RoPE base."""
    params = cfg.get("rope_parameters")  # transformers 5 spelling
    theta = cfg.get("rope_theta", params.get("rope_theta") if isinstance(params, dict) else None)
    if theta is None:
        raise ValueError(f"{path} lacks 'rope_theta' (the target's RoPE base the drafter uses)")
    return finite(theta, "rope_theta", path)


def _recorded_tli(cfg: dict[str, Any], path: Path) -> int | None:
    for key in _TLI_KEYS:
        if key in cfg:
            return whole(cfg[key], key, path)
    return None


def read_release_config(src: Path) -> ReleaseConfig:
    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{src} has no config.json")
    cfg = read_json_object(path)
    if cfg.get("disable_LSA"):
        raise ValueError(f"{path} sets disable_LSA: a drafter without LSA is not a MoA drafter")
    if cfg.get("model_type") == MOA_SPEC:
        layout, num_layers = MOA_SPEC, None
    elif "num_hidden_layers" in cfg:
        layout, num_layers = TRAINING, _int(cfg, "num_hidden_layers", path, TRAINING)
    else:
        raise ValueError(
            f"{path} is neither of the MoA release's layouts: no model_type 'moa_spec' (their "
            "vllm/convert_checkpoint.py's) and no 'num_hidden_layers' (their save_pretrained's); "
            "nor an EAGLE-3 release (no draft_vocab_size, no Eagle3 architecture, no midlayer.* "
            "tensors)"
        )
    hidden, theta = _int(cfg, "hidden_size", path, layout), _rope_theta(cfg, path)
    heads = _int(cfg, "num_attention_heads", path, layout)
    head_dim = whole(cfg.get("head_dim") or hidden // heads, "head_dim", path)
    if layout == MOA_SPEC:
        kv_width, odd = divmod(_int(cfg, "kv_hidden_size", path, layout), 2)
        stated = {
            k: whole(v, k, path)
            for k, v in cfg.items()
            if k.startswith(BLOCKS) and k.endswith(_SIZES)
        }
    else:
        kv_heads = whole(cfg.get("num_key_value_heads") or heads, "num_key_value_heads", path)
        kv_width, odd = kv_heads * head_dim, 0
        stated = {}
    if odd or kv_width % head_dim:
        raise ValueError(
            f"{path}: kv_hidden_size {2 * kv_width + odd} is not 2 * num_kv_heads * head_dim "
            f"(head_dim {head_dim})"
        )
    return ReleaseConfig(
        path=path,
        layout=layout,
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        kv_width=kv_width,
        vocab_size=_int(cfg, "vocab_size", path, layout),
        rope_theta=theta,
        rope_scaling=rope_scaling_in(cfg, path, hidden // heads, theta),  # their SA applies it
        rms_norm_eps=finite(cfg.get("rms_norm_eps", 1e-5), "rms_norm_eps", path),
        num_layers=num_layers,
        tli=_recorded_tli(cfg, path),
        stated=stated,
    )


def _check_against_target(release: ReleaseConfig, target: TargetInfo) -> None:
    """Refuse a release that contradicts the given target, naming both values."""
    shape = target.shape
    checks = [
        ("hidden_size", release.hidden_size, shape.hidden_size),
        ("num_attention_heads", release.num_heads, target.num_attention_heads),
        ("head size", release.head_dim, shape.head_dim),
        ("E_kv (num_key_value_heads * head_dim)", release.kv_width, shape.kv_width),
        ("vocab_size", release.vocab_size, shape.vocab_size),
        ("rope_theta", release.rope_theta, target.rope_theta),
        ("RoPE scaling", release.rope_scaling, shape.rope_scaling),
    ]
    if release.num_layers is not None:
        checks.append(("num_hidden_layers", release.num_layers, shape.num_layers))
    check_against_target(release.path, checks)


def target_of(release: ReleaseConfig, given: TargetInfo | None) -> TargetShape:
    """The target's shape: --target's (checked against the release), else the release's own."""
    if given is not None:
        _check_against_target(release, given)
        return given.shape
    if release.num_layers is None:
        raise ValueError(
            f"{release.path} is the moa_spec layout (their vllm/convert_checkpoint.py's), which "
            "drops num_hidden_layers, the target's layer count: pass --target TARGET_DIR"
        )
    return TargetShape(
        num_layers=release.num_layers,
        hidden_size=release.hidden_size,
        num_kv_heads=release.kv_width // release.head_dim,
        head_dim=release.head_dim,
        vocab_size=release.vocab_size,
        rope_scaling=release.rope_scaling,
    )


def _tli(asked: int | None, release: ReleaseConfig, num_layers: int) -> int:
    if asked is not None and release.tli is not None and asked != release.tli:
        raise ValueError(f"--tli {asked} contradicts {release.path}'s TLI {release.tli}")
    tli = asked if asked is not None else release.tli
    if tli is None:
        raise ValueError(
            f"{release.path} does not record TLI (how many of the target's last layers finish "
            "each draft; the paper trains 0, 1 or 3): pass --tli N as the release was trained"
        )
    if not 0 <= tli < num_layers:
        raise ValueError(f"TLI {tli} must be in [0, {num_layers}) for a {num_layers}-layer target")
    return tli


def _read_weights(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        tensors = load_state_dict(f)
        check_float_weights(tensors, f)
        state.update(tensors)
    return state


def _rename(key: str) -> str | None:
    """Release key -> our key; None to drop (copies of the target's shared weights)."""
    if key.startswith("model.") and key.split(".", 2)[1] in (*BLOCKS, "Ekv2E"):
        key = key[len("model.") :]
    if key.startswith(_SHARED_TARGET_KEYS):
        return None
    if key.startswith("cross_attention."):
        for alias, ours in _ATTN_ALIASES.items():
            key = key.replace(alias, ours)
    return key


def _drafter_state(src: Path) -> dict[str, torch.Tensor]:
    state = {new: t for k, t in _read_weights(src).items() if (new := _rename(k)) is not None}
    biases = sorted(k for k in state if k.endswith(".bias") and k != "Ekv2E.bias")
    if biases:
        raise ValueError(
            f"{src}: the release has attention biases ({', '.join(biases[:3])}), as a Qwen2 "
            "release's SA and LSA do; vllm-moa's MoA drafter has none: not supported yet"
        )
    if "Ekv2E.weight" not in state:
        raise ValueError(f"{src}: the release lacks Ekv2E.weight")
    return state


def _block_dims(
    state: dict[str, torch.Tensor], block: str, width: int, heads: int
) -> tuple[int, int]:
    """(num_kv_heads, intermediate_size) of a block of `width` with `heads` query heads."""
    try:
        q, k = state[f"{block}.self_attn.q_proj.weight"], state[f"{block}.self_attn.k_proj.weight"]
        mlp = state[f"{block}.mlp.gate_proj.weight"].shape[0]
    except KeyError as e:
        raise ValueError(f"the release lacks {e.args[0]}") from None
    head = width // heads
    if width % heads or tuple(q.shape) != (width, width) or k.shape[0] % head:
        raise ValueError(
            f"{block}: q_proj {tuple(q.shape)} and k_proj {tuple(k.shape)} do not fit width "
            f"{width} with {heads} heads of {head} (the target's num_attention_heads)"
        )
    return k.shape[0] // head, mlp


def _check_stated(release: ReleaseConfig, dims: dict[str, tuple[int, int]]) -> None:
    """The moa_spec layout's stated block sizes must be the tensors' (both come from shapes)."""
    for block, sizes in dims.items():
        for suffix, derived in zip(_SIZES, sizes, strict=True):
            stated = release.stated.get(block + suffix, derived)
            if stated != derived:
                raise ValueError(
                    f"{release.path} states {block + suffix}={stated} but the tensors give "
                    f"{derived}"
                )


def _memory_width(state: dict[str, torch.Tensor], target: TargetShape) -> int:
    """2*E_kv, the LSA width, checked against the target's K/V."""
    width = int(state["Ekv2E.weight"].shape[1])
    if width != 2 * target.kv_width:
        raise ValueError(
            f"Ekv2E takes {width} inputs but the target's 2*E_kv is {2 * target.kv_width}; pass "
            "--target with the real target directory"
        )
    return width


def moa_config(
    release: ReleaseConfig, target: TargetShape, state: dict[str, torch.Tensor], tli: int
) -> MoAConfig:
    """The drafter's configuration, every size from the release's config and tensor shapes."""
    heads, hidden = release.num_heads, target.hidden_size
    widths = dict(zip(BLOCKS, (_memory_width(state, target), hidden, hidden), strict=True))
    dims = {b: _block_dims(state, b, widths[b], heads) for b in BLOCKS}
    _check_stated(release, dims)
    (lsa_kv, lsa_mlp), (sa_kv, sa_mlp), (ca_kv, ca_mlp) = (dims[b] for b in BLOCKS)
    return MoAConfig(
        **MoAConfig.target_fields(target),
        lsa_num_heads=heads,
        lsa_num_kv_heads=lsa_kv,
        lsa_intermediate_size=lsa_mlp,
        sa_num_heads=heads,
        sa_num_kv_heads=sa_kv,
        sa_intermediate_size=sa_mlp,
        ca_num_heads=heads,
        ca_num_kv_heads=ca_kv,
        ca_intermediate_size=ca_mlp,
        tli=tli,
        rope_theta=release.rope_theta,
        lsa_rope_theta=release.rope_theta,
        sa_rope_scaling=release.rope_scaling,  # SA only, as their training code
        rms_norm_eps=release.rms_norm_eps,
    )


def convert_moa_release(
    src: str | Path, dst: str | Path, options: ConvertOptions | None = None
) -> Path:
    """Convert a released MoA drafter directory (either layout) into a vllm-moa drafter
    (`convert.convert_official` tells the authors' releases apart)."""
    opts = options or ConvertOptions()
    src = Path(src)
    release = read_release_config(src)
    target = target_of(release, opts.target)
    state = _drafter_state(src)
    _memory_width(state, target)  # a wrong target first: it also explains a wrong --tli range
    tli = _tli(opts.tli, release, target.num_layers)
    drafter = MoADrafter(moa_config(release, target, state, tli))
    load_checked(drafter, state, f"released checkpoint {src}")
    record = {"converted_from": f"MoA authors' release, {release.layout} layout"}
    return save_drafter(drafter.to(state["Ekv2E.weight"].dtype), dst, training=record)
