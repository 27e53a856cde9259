"""Export an EAGLE drafter of ours to vLLM's EAGLE-1 checkpoint format, and an EAGLE-3 drafter
to the layout the EAGLE-3 authors release and vLLM's `eagle3` method loads.

vLLM (`--speculative-config '{"method": "eagle", "model": DIR}'`) loads a Llama-style config
with one decoder layer (`EagleLlamaForCausalLM`: `fc` over [embedding | target hidden state], no
bias; layer 0 without input norm; output read by the LM head without a final norm) and weights
named `fc.weight`, `layers.0.self_attn.q_proj.weight`, ... Embeddings and LM head are left out,
so vLLM shares the target's, as our EAGLE baseline does.

EAGLE-3 (SafeAILab/EAGLE's training output, read by vLLM 0.32's llama_eagle3.py): the same Llama
config plus `draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` and
`num_aux_hidden_states` (so vLLM reads our feature layers whatever its default), and weights
`fc.weight` (nE -> E), `midlayer.<llama layer names>` (with `hidden_norm`; q, k, v read 2E),
`norm.weight` and `lm_head.weight` (draft_vocab_size rows); no embeddings (vLLM shares the
target's). With a reduced draft vocabulary also the authors' `d2t` (int64 [draft_vocab_size], the
offset: target id = draft id + d2t[draft id]) and `t2d` (bool [vocab_size]) under those names:
vLLM 0.32's `Eagle3LlamaForCausalLM.load_weights` (llama_eagle3.py:420-443) loads `d2t` into
`draft_id_to_target_id` (a long [draft_vocab_size] parameter it creates only when
draft_vocab_size differs from the target's vocabulary, :339-345) and skips `t2d`; its
`compute_logits` (:373-391) scatters the draft logits to `arange + d2t`, -inf elsewhere, as
`Eagle3Drafter.logits` does. With the whole vocabulary neither is written (vLLM would have no
parameter to load `d2t` into).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_moa.checkpoint.io import (
    CONFIG_NAME,
    WEIGHT_DTYPES,
    WEIGHTS_NAME,
    drafter_dir_of,
    load_config,
    load_drafter,
    read_header,
)
from vllm_moa.drafters.eagle.config import EagleConfig
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.eagle3.config import Eagle3Config
from vllm_moa.drafters.griffin.config import GriffinConfig
from vllm_moa.hf_target import load_target_info
from vllm_moa.model.config import read_config_json

# What vLLM's EAGLE models (llama_eagle.py: EAGLE-1, llama_eagle3.py: EAGLE-3) can hold, read
# from vLLM 0.32's sources: an fc (or EAGLE-3's norms over [embedding | feature]) into decoder
# layers whose one output is both what the LM head reads and the next step's feature.
GRIFFIN_NOT_EXPORTABLE = (
    "{path} holds a GRIFFIN drafter, which vLLM's EAGLE loaders cannot represent: its "
    "Token-Guided Fusion (a second, token-conditioned MLP with its own norms between fc and the "
    "layer, fc with a bias) and its Token-Enhanced Head (an MLP writing two states, one for the "
    "LM head and another fed to the next step) have no place in vLLM's EagleLlamaForCausalLM "
    "or Eagle3LlamaForCausalLM, whose single output serves both. Serve it with the standalone "
    "engine (`vllm-moa generate --drafter`); `--method eagle` trains a drafter vLLM can serve."
)


def _vllm_config(
    config: EagleConfig | Eagle3Config, target: dict[str, object], dtype: str
) -> dict[str, object]:
    head_dim = config.target_hidden_size // config.num_heads
    return {
        "architectures": ["LlamaForCausalLM"],  # vLLM's EAGLEConfig prefixes "Eagle"
        "model_type": "llama",
        "hidden_size": config.target_hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": _rope_parameters(config),
        "rope_theta": config.rope_theta,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def _rope_parameters(config: EagleConfig | Eagle3Config) -> dict[str, object]:
    """The drafter's RoPE as transformers 5 spells it in config.json: base and scaling in one
    `rope_parameters` dict ({"rope_type": "default", "rope_theta": ...} when unscaled). vLLM
    0.32 / 0.33 load the drafter's config with transformers (`patch_rope_parameters`, then
    `standardize_rope_params`) and build its layer's rotary from `config.rope_parameters`
    (llama.py's `get_rope(..., rope_parameters=...)`, which llama_eagle.py and
    llama_eagle3.py use), so this dict is what they apply; the top-level `rope_theta` repeats
    the base for older readers."""
    scaling = config.rope_scaling or {"rope_type": "default"}
    return {**scaling, "rope_theta": config.rope_theta}


def vllm_method_of(drafter_dir: str | Path) -> str:
    """The vLLM speculative method that serves the export of the drafter at `drafter_dir`."""
    return (
        "eagle3" if isinstance(load_config(drafter_dir_of(drafter_dir)), Eagle3Config) else "eagle"
    )


def _eagle3_keys(config: Eagle3Config) -> dict[str, object]:
    return {
        "target_hidden_size": config.target_hidden_size,
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "num_aux_hidden_states": len(config.feature_layers),
    }


def export_vllm_eagle(drafter_dir: str | Path, target_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `out_dir` (config.json + model.safetensors) that vLLM's `eagle` method loads, or
    its `eagle3` method for an EAGLE-3 drafter (`vllm_method_of`)."""
    drafter_dir, out = drafter_dir_of(drafter_dir), Path(out_dir)
    config = load_config(drafter_dir)
    if isinstance(config, GriffinConfig):
        raise ValueError(GRIFFIN_NOT_EXPORTABLE.format(path=drafter_dir))
    if not isinstance(config, (EagleConfig, Eagle3Config)):
        raise ValueError(
            f"{drafter_dir} holds a {config.MODEL_TYPE} drafter; only EAGLE and EAGLE-3 "
            "drafters (`vllm-moa train --method eagle` or `eagle3`) have a vLLM EAGLE format. "
            'MoA drafters are served as they are: --speculative-config \'{"method": "moa", ...}\''
        )
    target = read_config_json(Path(target_dir) / CONFIG_NAME)
    config.check_target(load_target_info(target_dir).shape)
    drafter = load_drafter(drafter_dir)
    assert isinstance(drafter, EagleDrafter)
    # Written in the dtype the drafter is stored in (load_drafter gives float32), so a
    # bfloat16 drafter exports as bfloat16, its values unchanged.
    stored = read_header(drafter_dir / WEIGHTS_NAME)["fc.weight"].dtype
    drafter = drafter.to(getattr(torch, WEIGHT_DTYPES[stored]))
    # Ours: fc.weight, layer.<llama names> (EAGLE-3: also norm, lm_head); vLLM's EAGLE:
    # layers.0.<llama names>; EAGLE-3's release: midlayer.<llama names>.
    layer = "midlayer." if isinstance(config, Eagle3Config) else "layers.0."
    tensors = {
        (layer + name.removeprefix("layer.") if name.startswith("layer.") else name): t
        for name, t in drafter.state_dict().items()
    }
    dtype = str(drafter.fc.weight.dtype).removeprefix("torch.")
    config_json = _vllm_config(config, target, dtype)
    if isinstance(config, Eagle3Config):
        config_json |= _eagle3_keys(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(config_json, indent=2) + "\n")
    save_file(
        {k: v.detach().contiguous() for k, v in tensors.items()},
        str(out / WEIGHTS_NAME),
        metadata={"format": "pt"},
    )
    return out
