"""Export an EAGLE-3 drafter of ours to the EAGLE-3 checkpoint layout the authors release and
vLLM's `eagle3` method loads (`--speculative-config '{"method": "eagle3", "model": DIR}'`).

The layout (SafeAILab/EAGLE's training output, read by vLLM 0.32's llama_eagle3.py): a Llama-style
config.json with one decoder layer plus `draft_vocab_size` and `target_hidden_size`, and weights
`fc.weight` (3E -> E), `midlayer.<llama layer names>` (with `midlayer.hidden_norm.weight`; q, k,
v read 2E), `norm.weight` and `lm_head.weight`. The embeddings are left out, so vLLM shares the
target's (as ours does); `d2t` is left out too (the draft vocabulary is the target's). vLLM's
`eagle_aux_hidden_state_layer_ids` and `num_aux_hidden_states` name our feature layers, so vLLM
reads the target states we trained on whatever its default.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from vllm_moa.checkpoint.io import CONFIG_NAME, WEIGHTS_NAME, load_drafter
from vllm_moa.drafters.eagle3.config import Eagle3Config
from vllm_moa.drafters.eagle3.model import Eagle3Drafter


def vllm_eagle3_config(
    config: Eagle3Config, target: dict[str, object], dtype: str
) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],  # vLLM's EAGLEConfig makes it Eagle3Llama...
        "model_type": "llama",
        "hidden_size": config.target_hidden_size,
        "target_hidden_size": config.target_hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.target_hidden_size // config.num_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "num_aux_hidden_states": len(config.feature_layers),
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def export_vllm_eagle3(
    drafter_dir: Path, config: Eagle3Config, target: dict[str, object], out: Path
) -> Path:
    """Write `out` (config.json + model.safetensors) in the EAGLE-3 release layout."""
    drafter = load_drafter(drafter_dir)
    assert isinstance(drafter, Eagle3Drafter)
    # Ours: layer.<names>; theirs and vLLM's: midlayer.<names>. fc, norm, lm_head as they are.
    tensors = {
        ("midlayer." + name.removeprefix("layer.") if name.startswith("layer.") else name): t
        for name, t in drafter.state_dict().items()
    }
    out.mkdir(parents=True, exist_ok=True)
    dtype = str(drafter.fc.weight.dtype).removeprefix("torch.")
    config_json = vllm_eagle3_config(config, target, dtype)
    (out / CONFIG_NAME).write_text(json.dumps(config_json, indent=2) + "\n")
    save_file(
        {k: v.detach().contiguous() for k, v in tensors.items()},
        str(out / WEIGHTS_NAME),
        metadata={"format": "pt"},
    )
    return out
