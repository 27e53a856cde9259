"""Import the EAGLE-3 authors' released drafters (SafeAILab/EAGLE, e.g.
`yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`) into our EAGLE-3 drafter (drafters/eagle3/;
docs/official_checkpoints.md).

Their layout (their trainer's output, which vLLM 0.32's llama_eagle3.py loads, and which
`vllm-moa export-eagle` writes: converting is its inverse): a Llama config.json for one decoder
layer (`architectures` LlamaForCausalLM or LlamaForCausalLMEagle3) with `draft_vocab_size`, and
weights (model.safetensors, or pytorch_model.bin as on their Hugging Face pages) `fc.weight`
(nE -> E), `midlayer.<Llama layer names>` with `hidden_norm` (q, k, v read 2E; our `layer.*`),
`norm.weight`, `lm_head.weight` (draft_vocab_size rows), `d2t` (int [draft_vocab_size], the
offset: target id = draft id + d2t[draft id]) and `t2d` (bool [vocab_size]). No embedding: the
drafter reads the target's, as ours does.

The release does not state the target's layer count (where `eagle_aux_hidden_state_layer_ids`,
if absent the authors' and vLLM's (2, L//2, L-3), must lie) nor its KV heads, which our config
records: --target is required, and the release is checked against it. Refused, in one line
naming the file: a layout our drafter cannot represent (vLLM's variants `norm_before_residual`,
`norm_before_fc`, `fc_norm`, `norm_output`, no aux states, more than one layer, a width other
than the target's, biases, the speculators format), missing or extra tensors, shapes other than
config.json's sizes give, a d2t / t2d that contradicts draft_vocab_size or each other, and
what release_files.py refuses (damaged JSON, non-float or NaN / Inf weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_moa.checkpoint.io import check_tensors, save_drafter
from vllm_moa.checkpoint.release_files import (
    AGAIN,
    check_against_target,
    check_float_weights,
    finite,
    load_weights_file,
    positive,
    read_json_object,
    rope_scaling_in,
    weight_files,
    whole,
)
from vllm_moa.checkpoint.validate import expected_shapes
from vllm_moa.drafters.eagle3.config import Eagle3Config
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.model.config import DrafterConfig, TargetShape
from vllm_moa.model.target_info import TargetInfo

MAPS = ("d2t", "t2d")  # the draft vocabulary's index maps, the release's only non-float tensors
# Defaults where config.json is silent: transformers' LlamaConfig's, which vLLM and the authors'
# config class read the release with (their RoPE base is 10000 when `rope_theta` is absent).
_DEFAULT_THETA, _DEFAULT_EPS = 10000.0, 1e-6
# vLLM's EAGLE-3 variants (llama_eagle3.py), set at the top level or in `eagle_config`, that our
# Eagle3Block / Eagle3Drafter do not compute: what each changes.
_VARIANTS = {
    "norm_before_residual": "the residual is hidden_norm(h), not h",
    "norm_before_fc": "an RMSNorm before fc",
    "fc_norm": "an RMSNorm on each target state before fc",
    "norm_output": "the next step reads the normalised output",
}


@dataclass(frozen=True)
class Eagle3Release:
    """What an EAGLE-3 release's config.json states; sizes are the drafter's."""

    path: Path  # its config.json, for messages
    hidden_size: int  # E: the drafter's width, which must be the target's
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # as rope_scaling_of records it; None: plain RoPE
    rms_norm_eps: float
    vocab_size: int | None  # the target's vocabulary as stated; None: not stated
    draft_vocab_size: int | None  # the LM head's rows; None: not stated (the whole vocabulary)
    feature_layers: tuple[int, ...] | None  # eagle_aux_hidden_state_layer_ids; None: not stated


@dataclass(frozen=True)
class ReleaseWeights:
    tensors: dict[str, torch.Tensor]  # under the release's names
    source: Path  # the weights file, or the directory when it holds several: for messages


def _eagle_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """vLLM's nested `eagle_config` dict (aux layer ids, variants), {} when absent."""
    nested = cfg.get("eagle_config")
    return nested if isinstance(nested, dict) else {}


def is_eagle3_release(src: Path, cfg: dict[str, Any]) -> bool:
    """Whether `src` (with config.json `cfg`) holds an EAGLE-3 drafter in the authors' layout or
    a format vLLM's `eagle3` reads: an architecture named Eagle3 (vLLM's test), EAGLE-3's
    config keys, or `midlayer.*` tensors."""
    archs = cfg.get("architectures")
    named = isinstance(archs, list) and any(
        isinstance(a, str) and (a.startswith("Eagle3") or a.endswith("Eagle3")) for a in archs
    )
    keys = {"draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "speculators_model_type"}
    stated = bool(keys & (set(cfg) | set(_eagle_config(cfg))))
    return named or stated or any(n.startswith("midlayer.") for n in _safetensors_names(src))


def _safetensors_names(src: Path) -> list[str]:
    """The tensor names in `src`'s safetensors headers; [] when unreadable (the converter that
    reads them next names the damage)."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for file in sorted(src.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                names.extend(f.keys())
        except (SafetensorError, OSError):
            return []
    return names


def _refuse_variants(cfg: dict[str, Any], path: Path) -> None:
    """Refuse a config.json setting what our drafter does not compute, naming the key."""
    if "speculators_model_type" in cfg:
        raise ValueError(
            f"{path} is in the speculators format (vllm-project/speculators: its own keys and "
            "tensor names, norm_before_residual by default), not the EAGLE-3 authors' layout: "
            "not supported; serve it with vLLM's eagle3 directly"
        )
    nested = _eagle_config(cfg)
    for key, what in _VARIANTS.items():
        if cfg.get(key) or nested.get(key):
            raise ValueError(f"{path} sets {key} ({what}): our EAGLE-3 drafter has no such variant")
    if nested.get("use_aux_hidden_state") is False:
        raise ValueError(
            f"{path} sets use_aux_hidden_state false: EAGLE-3 without fc over aux states"
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{path} sets {key}: our EAGLE-3 drafter's layer has no biases")
    checks = [
        ("num_hidden_layers", 1, "one decoder layer, as the authors train"),
        ("hidden_act", "silu", "the SiLU MLP of Llama"),
        ("logit_scale", 1.0, "unscaled logits"),
        ("target_hidden_size", cfg.get("hidden_size"), "the drafter's width is the target's"),
    ]
    for key, ours, why in checks:
        if cfg.get(key, ours) != ours:
            raise ValueError(
                f"{path} has {key} {cfg[key]!r}; our EAGLE-3 drafter needs {ours!r} ({why})"
            )


def _feature_layers(cfg: dict[str, Any], path: Path) -> tuple[int, ...] | None:
    key = "eagle_aux_hidden_state_layer_ids"
    layers = cfg.get(key) or _eagle_config(cfg).get(key)
    if layers is None:
        return None
    if not isinstance(layers, list):
        raise ValueError(f"{path}: {key} must be a list of layer ids, got {layers!r}; {AGAIN}")
    return tuple(whole(layer, key, path) for layer in layers)


def read_eagle3_release(src: Path) -> Eagle3Release:
    """The release's config.json, every field our EAGLE-3 config takes, checked."""
    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{src} has no config.json")
    cfg = read_json_object(path)
    _refuse_variants(cfg, path)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if key not in cfg:
            raise ValueError(f"{path} lacks {key!r}, which an EAGLE-3 release states; {AGAIN}")
    hidden, heads = positive(cfg["hidden_size"], "hidden_size", path), cfg["num_attention_heads"]
    heads = positive(heads, "num_attention_heads", path)
    if cfg.get("head_dim", hidden // heads) != hidden // heads:
        raise ValueError(
            f"{path}: head_dim {cfg['head_dim']} is not hidden_size / num_attention_heads = "
            f"{hidden // heads}, which our EAGLE-3 drafter's heads are"
        )
    params = cfg.get("rope_parameters")  # transformers 5 spelling
    theta = cfg.get("rope_theta", params.get("rope_theta") if isinstance(params, dict) else None)
    theta = finite(_DEFAULT_THETA if theta is None else theta, "rope_theta", path)
    optional = {
        k: positive(cfg[k], k, path) for k in ("vocab_size", "draft_vocab_size") if k in cfg
    }
    return Eagle3Release(
        path=path,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=positive(cfg.get("num_key_value_heads", heads), "num_key_value_heads", path),
        intermediate_size=positive(cfg["intermediate_size"], "intermediate_size", path),
        rope_theta=theta,
        rope_scaling=rope_scaling_in(cfg, path, hidden // heads, theta),
        rms_norm_eps=finite(cfg.get("rms_norm_eps", _DEFAULT_EPS), "rms_norm_eps", path),
        vocab_size=optional.get("vocab_size"),
        draft_vocab_size=optional.get("draft_vocab_size"),
        feature_layers=_feature_layers(cfg, path),
    )


def _check_against_target(release: Eagle3Release, target: TargetShape) -> None:
    """Refuse a release that contradicts the target, naming both values. Its RoPE scaling, when
    it states one, is the target's (our drafter applies the target's, TokenLayerConfig)."""
    checks: list[tuple[str, object, object]] = [
        ("hidden_size", release.hidden_size, target.hidden_size)
    ]
    if release.vocab_size is not None:
        checks.append(("vocab_size", release.vocab_size, target.vocab_size))
    if release.rope_scaling is not None:
        checks.append(("RoPE scaling", release.rope_scaling, target.rope_scaling))
    check_against_target(release.path, checks)


def eagle3_config(release: Eagle3Release, target: TargetInfo) -> Eagle3Config:
    """Our config: the release's sizes, the target's shape; the feature layers the release
    states, else the authors' (2, L//2, L-3), which vLLM assumes too."""
    shape = target.shape
    _check_against_target(release, shape)
    num_layers = shape.num_layers
    layers = release.feature_layers or (2, num_layers // 2, num_layers - 3)
    try:
        return Eagle3Config(
            **DrafterConfig.target_fields(shape),
            num_heads=release.num_heads,
            num_kv_heads=release.num_kv_heads,
            intermediate_size=release.intermediate_size,
            rope_theta=release.rope_theta,
            rms_norm_eps=release.rms_norm_eps,
            rope_scaling=release.rope_scaling,
            feature_layers=layers,
            draft_vocab_size=release.draft_vocab_size or shape.vocab_size,
        )
    except (TypeError, ValueError) as e:
        stated = "" if release.feature_layers else " (the authors' default; it states none)"
        raise ValueError(
            f"{release.path}, feature layers {list(layers)}{stated}, with a {num_layers}-layer "
            f"target: {e}"
        ) from None


def read_weights(src: Path) -> ReleaseWeights:
    """Every tensor of the release's weights files, the float ones checked (release_files)."""
    files = weight_files(src)
    if not files:
        raise FileNotFoundError(
            f"{src} has no weights (no *.safetensors, no pytorch_model*.bin): pass the release's "
            "directory as downloaded"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        state = load_weights_file(file)
        check_float_weights({n: t for n, t in state.items() if n not in MAPS}, file)
        tensors.update(state)
    return ReleaseWeights(tensors, files[0] if len(files) == 1 else src)


def vocab_maps(weights: ReleaseWeights, config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Our d2t (int64) and t2d from the release's: none for a whole-vocabulary head, whose maps,
    if present, must be the identity."""
    d2t, t2d = (weights.tensors.get(name) for name in MAPS)
    source, n, vocab = weights.source, config.draft_vocab_size, config.vocab_size
    if (d2t is not None and (d2t.is_floating_point() or d2t.dtype == torch.bool)) or (
        t2d is not None and t2d.dtype != torch.bool
    ):
        got = {name: str(weights.tensors[name].dtype) for name in MAPS if name in weights.tensors}
        raise ValueError(
            f"{source}: d2t must be integer and t2d bool, got {got}: a foreign or damaged copy; "
            f"{AGAIN}"
        )
    sizes = {"d2t": (d2t, n, "draft_vocab_size"), "t2d": (t2d, vocab, "vocab_size")}
    for name, (t, size, what) in sizes.items():
        if t is not None and tuple(t.shape) != (size,):
            raise ValueError(
                f"{source}: {name} has shape {tuple(t.shape)} but {what} is {size}: config.json "
                f"(or the target) and the weights come from different drafters; {AGAIN}"
            )
    if not config.reduced_vocab:
        if (d2t is not None and bool(d2t.any())) or (t2d is not None and not bool(t2d.all())):
            raise ValueError(
                f"{source}: draft_vocab_size {n} is the whole vocabulary, but d2t / t2d do not map "
                "every draft id to itself: the config and the maps come from different drafters"
            )
        return {}
    if d2t is None:
        raise ValueError(
            f"{source} lacks d2t, which maps a reduced draft vocabulary (draft_vocab_size {n} < "
            f"vocab_size {vocab}) to target ids; {AGAIN}"
        )
    ids = torch.arange(n) + d2t.long()  # target id of each draft id
    if not (bool((ids[1:] > ids[:-1]).all()) and bool(((ids >= 0) & (ids < vocab)).all())):
        raise ValueError(
            f"{source}: d2t maps draft ids to target ids (draft id + d2t) that are not strictly "
            f"ascending in 0..{vocab - 1}, as the authors' (sorted) and our drafter's are; {AGAIN}"
        )
    marked = torch.zeros(vocab, dtype=torch.bool)
    marked[ids] = True
    if t2d is not None and not torch.equal(t2d, marked):
        raise ValueError(
            f"{source}: t2d marks {int(t2d.sum())} target tokens, not the {n} d2t maps draft ids "
            f"to: the two come from different drafters; {AGAIN}"
        )
    return {"d2t": ids - torch.arange(n), "t2d": marked}


def release_name(ours: str) -> str:
    """Our key -> the release's (export-eagle's renaming): our `layer.*` is their `midlayer.*`;
    fc, norm, lm_head, d2t and t2d are named alike."""
    return "midlayer." + ours.removeprefix("layer.") if ours.startswith("layer.") else ours


def our_name(theirs: str) -> str:
    """The release's key -> ours, the inverse of `release_name`."""
    return "layer." + theirs.removeprefix("midlayer.") if theirs.startswith("midlayer.") else theirs


def _check_shapes(weights: ReleaseWeights, config: Eagle3Config) -> None:
    """The release's tensors (maps taken out) must be those of a drafter of config.json's sizes,
    named and shaped alike (under the release's names)."""
    expected = {release_name(n): s for n, s in expected_shapes(config).items() if n not in MAPS}
    stored = {n: tuple(t.shape) for n, t in weights.tensors.items() if n not in MAPS}
    hint = ""
    if any("embed_tokens" in n for n in set(stored) - set(expected)):
        hint = (
            " (an embedding of its own: the authors' releases have none, ours reads the target's)"
        )
    try:
        check_tensors(expected, stored, str(weights.source))
    except ValueError as e:
        raise ValueError(
            f"{e}{hint}: not the EAGLE-3 authors' layout, or config.json and the weights come "
            f"from different drafters; {AGAIN}"
        ) from None


def convert_eagle3_release(src: Path, dst: str | Path, target: TargetInfo | None) -> Path:
    """Convert the EAGLE-3 release in `src` into our EAGLE-3 drafter directory `dst`, in the
    release's dtype; `target` (--target) is required."""
    release = read_eagle3_release(src)
    if target is None:
        raise ValueError(
            f"{src} is an EAGLE-3 release, which does not record its target's layer count and KV "
            "heads (our drafter's config does): pass --target TARGET_DIR, the model it drafts for"
        )
    config = eagle3_config(release, target)
    weights = read_weights(src)
    maps = vocab_maps(weights, config)
    _check_shapes(weights, config)
    dtype = weights.tensors["fc.weight"].dtype
    drafter = Eagle3Drafter(config).to(dtype)
    state = {our_name(n): t for n, t in weights.tensors.items() if n not in MAPS}
    drafter.load_state_dict(state | maps)
    record = {"converted_from": "EAGLE-3 authors' release (SafeAILab/EAGLE layout)"}
    return save_drafter(drafter, dst, training=record)
