"""Widen a trained target and its drafters into a function-identical pair of realistic cost.

A small trained pair makes every draft step cost about what a target step costs, so no
speculative method can pay on it; real deployments pair an 8B target with a ~250M drafter.
`inflate` zero-pads the residual width E -> E', the MLP width I -> I' and the query heads
H -> H' (KV heads and head size unchanged, so the K/V every layer caches, which LSA reads, are
unchanged) and keeps every logit:

- embeddings, LM head and every matrix reading or writing the residual stream get zero rows /
  columns for the new dimensions, which therefore stay zero through the network;
- RMSNorm over E' of a zero-padded x is sqrt(E / E') times RMSNorm over E once eps is scaled by
  E / E' as well: norm weights become w * sqrt(E / E'), eps becomes eps * E / E';
- new query heads have zero q rows and zero o_proj columns (attention output that is never
  read); old head j of KV group g moves to g * (H' / Hkv) + j mod (H / Hkv), keeping its KV head;
- new MLP channels have zero gate/up rows and down columns (silu(0) * 0 = 0).

Drafters are widened only where the target's width forces it (SA/CA/EAGLE/EAGLE-3/independent
blocks: E -> E', heads x E' / E to keep their head size); their MLPs keep their width, so a drafter
stays as small next to the target as it can (a width-E' block costs a quarter of a layer of a
4-layer target whatever its MLP). MoA's LSA reads the unchanged K/V and stays as it is (its eps
is kept apart: `lsa_rms_norm_eps`). Targets: Hugging Face llama, mistral, qwen2, qwen3 checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_moa.checkpoint.io import load_drafter, save_drafter
from vllm_moa.drafters.eagle.config import EagleConfig
from vllm_moa.drafters.eagle3.config import Eagle3Config
from vllm_moa.drafters.independent.config import IndependentConfig
from vllm_moa.drafters.moa.config import MoAConfig

SUPPORTED_TARGETS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Widening:
    """One block stack's widths before and after: residual E, MLP I, query heads H (head size D
    and KV heads fixed)."""

    hidden: int
    new_hidden: int
    intermediate: int
    new_intermediate: int
    heads: int
    new_heads: int
    kv_heads: int
    head_dim: int

    @property
    def norm_scale(self) -> float:
        return math.sqrt(self.hidden / self.new_hidden)

    def head_index(self) -> torch.Tensor:
        """New index of each old query head (GQA groups kept)."""
        group, new_group = self.heads // self.kv_heads, self.new_heads // self.kv_heads
        old = torch.arange(self.heads)
        return (old // group) * new_group + old % group

    def check(self, what: str) -> None:
        if self.new_hidden < self.hidden or self.new_intermediate < self.intermediate:
            raise ValueError(
                f"{what}: inflate only widens (hidden {self.hidden} -> {self.new_hidden}, "
                f"intermediate {self.intermediate} -> {self.new_intermediate})"
            )
        if self.new_heads < self.heads or self.new_heads % self.kv_heads:
            raise ValueError(
                f"{what}: --num-heads {self.new_heads} must be at least {self.heads} and a "
                f"multiple of the {self.kv_heads} KV heads"
            )


def _pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _place_heads(t: torch.Tensor, dim: int, w: Widening) -> torch.Tensor:
    """Move the query heads along `dim` (H * D -> H' * D) to their new places, zeros elsewhere."""
    d = w.head_dim
    rows = (w.head_index()[:, None] * d + torch.arange(d)).flatten()
    shape = list(t.shape)
    shape[dim] = w.new_heads * d
    out = torch.zeros(shape, dtype=t.dtype)
    out.index_copy_(dim, rows, t)
    return out


def widen_tensor(name: str, t: torch.Tensor, w: Widening) -> torch.Tensor:
    """One tensor of a decoder block or of the residual stream's ends, by its (HF/Llama) name."""
    e, i = w.new_hidden, w.new_intermediate
    leaf = name.rsplit(".", 2)
    role = ".".join(leaf[-2:])
    if role in ("q_norm.weight", "k_norm.weight"):
        return t  # per head, head size unchanged
    if name.endswith("norm.weight"):  # input / post-attention / final RMSNorm over E
        return _pad(t, (e,)) * w.norm_scale
    if role == "q_proj.weight":
        return _pad(_place_heads(t, 0, w), (w.new_heads * w.head_dim, e))
    if role == "q_proj.bias":
        return _place_heads(t, 0, w)
    if role in ("k_proj.weight", "v_proj.weight"):
        return _pad(t, (t.shape[0], e))
    if role in ("k_proj.bias", "v_proj.bias"):
        return t
    if role == "o_proj.weight":
        return _pad(_place_heads(t, 1, w), (e, w.new_heads * w.head_dim))
    if role in ("gate_proj.weight", "up_proj.weight"):
        return _pad(t, (i, e))
    if role == "down_proj.weight":
        return _pad(t, (e, i))
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return _pad(t, (t.shape[0], e))
    raise ValueError(f"inflate does not know how to widen {name} {tuple(t.shape)}")


# -- targets ----------------------------------------------------------------------------------


def target_widening(config: dict, hidden: int, intermediate: int, heads: int) -> Widening:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TARGETS:
        raise ValueError(
            f"inflate supports {', '.join(SUPPORTED_TARGETS)} targets; this one is {model_type!r}"
        )
    old_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // old_heads)
    w = Widening(
        hidden=int(config["hidden_size"]),
        new_hidden=hidden,
        intermediate=int(config["intermediate_size"]),
        new_intermediate=intermediate,
        heads=old_heads,
        new_heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or old_heads),
        head_dim=head_dim,
    )
    w.check("target")
    return w


def inflate_target(
    target: str | Path, out: str | Path, hidden: int, intermediate: int, heads: int
) -> Widening:
    """Write the widened copy of the HF checkpoint `target` to `out` (one model.safetensors,
    fp32 kept as stored; tokenizer and other files copied)."""
    src, dst = Path(target), Path(out)
    config = json.loads((src / "config.json").read_text())
    w = target_widening(config, hidden, intermediate, heads)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {src}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    widened = {name: widen_tensor(name, t, w).contiguous() for name, t in state.items()}
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if (
            item.is_file()
            and item.suffix != ".safetensors"
            and item.name
            not in (
                "config.json",
                "model.safetensors.index.json",
            )
        ):
            shutil.copy(item, dst / item.name)
    config.update(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        head_dim=w.head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)) * w.hidden / hidden,
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(widened, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return w


# -- drafters ---------------------------------------------------------------------------------


def _block_widening(
    target: Widening, heads: int, kv_heads: int, intermediate: int, what: str
) -> Widening:
    """A drafter block at the target's new width (heads scaled with it, MLP unchanged)."""
    head_dim = target.hidden // heads
    if target.new_hidden % head_dim:
        raise ValueError(f"{what}: head size {head_dim} does not divide {target.new_hidden}")
    w = Widening(
        hidden=target.hidden,
        new_hidden=target.new_hidden,
        intermediate=intermediate,
        new_intermediate=intermediate,
        heads=heads,
        new_heads=target.new_hidden // head_dim,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    w.check(what)
    return w


def _widen_state(
    state: dict[str, torch.Tensor], blocks: dict[str, Widening], keep: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name.startswith(keep):
            out[name] = t
            continue
        prefix = next((p for p in blocks if name.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"inflate does not know how to widen drafter tensor {name}")
        out[name] = widen_tensor(name, t, blocks[prefix])
    return out


def inflate_drafter(path: str | Path, out: str | Path, target: Widening) -> Path:
    """Widen a drafter of ours (MoA, EAGLE, EAGLE-3 or independent) built for the target
    `target` widens; write it to `out`."""
    drafter = load_drafter(path)
    config = drafter.config
    e, e2 = target.hidden, target.new_hidden
    # Weights in float32 to widen; index buffers (MoA's draft_ids) as they are.
    state = {
        k: v.detach().float() if v.is_floating_point() else v.detach()
        for k, v in drafter.state_dict().items()
    }
    new: nn.Module
    if isinstance(config, MoAConfig):
        sa = _block_widening(
            target, config.sa_num_heads, config.sa_num_kv_heads, config.sa_intermediate_size, "SA"
        )
        ca = _block_widening(
            target, config.ca_num_heads, config.ca_num_kv_heads, config.ca_intermediate_size, "CA"
        )
        state = _widen_state(
            {k: v for k, v in state.items() if not k.startswith("Ekv2E.")},
            {"self_attention.": sa, "cross_attention.": ca},
            keep=("layer_self_attention.", "draft_ids"),  # draft_ids: token ids, any width
        ) | {
            "Ekv2E.weight": _pad(state["Ekv2E.weight"], (e2, state["Ekv2E.weight"].shape[1])),
            "Ekv2E.bias": _pad(state["Ekv2E.bias"], (e2,)),
        }
        new_config: MoAConfig | EagleConfig | Eagle3Config | IndependentConfig = (
            dataclasses.replace(
                config,
                target_hidden_size=e2,
                sa_num_heads=sa.new_heads,
                sa_intermediate_size=sa.new_intermediate,
                ca_num_heads=ca.new_heads,
                ca_intermediate_size=ca.new_intermediate,
                rms_norm_eps=config.rms_norm_eps * e / e2,
                lsa_rms_norm_eps=config.lsa_rms_norm_eps or config.rms_norm_eps,
            )
        )
    elif isinstance(config, (EagleConfig, Eagle3Config, IndependentConfig)):
        w = _block_widening(
            target, config.num_heads, config.num_kv_heads, config.intermediate_size, "drafter"
        )
        fc = state.pop("fc.weight", None)
        # EAGLE-3's q, k, v read [N(embedding) | N(feature)], 2E: each half widens as an E-wide
        # input, the halves placed at 0 and E'.
        two_wide = {
            name: torch.cat([widen_tensor(name, half, w) for half in t.split(e, dim=1)], dim=1)
            for name, t in state.items()
            if isinstance(config, Eagle3Config)
            and name.startswith("layer.self_attn.")
            and name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        }
        state = (
            _widen_state(
                {k: v for k, v in state.items() if k not in two_wide},
                {"layer.": w, "layers.": w, "norm.": w, "lm_head.": w},
            )
            | two_wide
        )
        if fc is not None:  # EAGLE: [E, 2E] over [token embedding | feature]; EAGLE-3: [E, nE]
            n = fc.shape[1] // e  # over n target states
            wide = torch.zeros(e2, n * e2)
            for j in range(n):
                wide[:e, j * e2 : j * e2 + e] = fc[:, j * e : (j + 1) * e]
            state["fc.weight"] = wide
        new_config = dataclasses.replace(
            config,
            target_hidden_size=e2,
            num_heads=w.new_heads,
            intermediate_size=w.new_intermediate,
            rms_norm_eps=config.rms_norm_eps * e / e2,
        )
    else:
        raise ValueError(f"inflate does not support {type(config).__name__} drafters")
    new = type(drafter)(new_config)
    new.load_state_dict(state)
    return save_drafter(new, out)
