"""Export of our EAGLE drafter to vLLM's EAGLE-1 format: names, config and numerics checked
against transformers' own Llama layer (the naming vLLM's loader maps from). Serving the
exported checkpoint in vLLM: tests/vllm_integration/test_vllm_eagle.py."""

import json

import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file

from vllm_moa.checkpoint import save_drafter
from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle
from vllm_moa.cli.main import main
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.griffin.model import GriffinDrafter
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.presets import make_config, make_eagle_config, make_griffin_config
from vllm_moa.hf_target import load_target_info


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle_export")
    make_hf_model(vocab_size=96, seed=3).save_pretrained(base / "target")
    info = load_target_info(base / "target")
    drafter = EagleDrafter(make_eagle_config(info, "small"))
    drafter.init_weights(seed=5, std=0.1)
    save_drafter(drafter, base / "eagle")
    moa = MoADrafter(make_config(info, preset="small"))
    moa.init_weights(seed=0)
    save_drafter(moa, base / "moa")
    griffin = GriffinDrafter(make_griffin_config(info, preset="small"))
    griffin.init_weights(seed=0)
    save_drafter(griffin, base / "griffin")
    return base, drafter


def test_export_matches_transformers_llama_layer(pair, tmp_path):
    """The exported layer, loaded into transformers' LlamaModel by name (input norm and final
    norm made identities, as in vLLM's EagleLlamaForCausalLM), computes what our drafter does."""
    from transformers import LlamaConfig, LlamaModel

    base, drafter = pair
    out = export_vllm_eagle(base / "eagle", base / "target", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 1
    assert config["intermediate_size"] == drafter.config.intermediate_size
    weights = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)  # target's

    llama = LlamaModel(LlamaConfig(**config, attn_implementation="eager")).eval()
    result = llama.load_state_dict({k: v for k, v in weights.items() if k != "fc.weight"}, False)
    assert not result.unexpected_keys
    assert sorted(result.missing_keys) == [
        "embed_tokens.weight",
        "layers.0.input_layernorm.weight",
        "norm.weight",
    ]
    llama.layers[0].input_layernorm = torch.nn.Identity()
    llama.norm = torch.nn.Identity()

    gen = torch.Generator().manual_seed(0)
    e = drafter.config.target_hidden_size
    embeds, features = torch.randn(2, 11, e, generator=gen), torch.randn(2, 11, e, generator=gen)
    with torch.no_grad():
        fused = torch.cat([embeds, features], -1) @ weights["fc.weight"].T
        theirs = llama(inputs_embeds=fused).last_hidden_state
        ours = drafter(embeds, features)
    # fp32, same operations in a different order: rounding-level differences only.
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_export_cli_accepts_train_out_dir_and_refuses_moa(pair, tmp_path, capsys):
    base, _ = pair
    (tmp_path / "run").mkdir()
    (base / "eagle").rename(tmp_path / "run" / "drafter")
    try:
        assert main(["export-eagle", "--drafter", str(tmp_path / "run"), "--target",
                     str(base / "target"), "--out", str(tmp_path / "v")]) == 0  # fmt: skip
        assert '"method": "eagle"' in capsys.readouterr().out
        assert (tmp_path / "v" / "model.safetensors").is_file()
    finally:
        (tmp_path / "run" / "drafter").rename(base / "eagle")
    assert main(["export-eagle", "--drafter", str(base / "moa"), "--target",
                 str(base / "target"), "--out", str(tmp_path / "m")]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "only EAGLE and EAGLE-3" in err and '"method": "moa"' in err


def test_export_refuses_griffin_saying_why(pair, tmp_path):
    """vLLM's EAGLE models have no Token-Guided Fusion and one output for both the LM head and
    the next step: a GRIFFIN drafter is refused, not exported as a wrong EAGLE."""
    base, _ = pair
    with pytest.raises(ValueError, match=r"GRIFFIN drafter.*Token-Guided Fusion.*Token-Enhanced"):
        export_vllm_eagle(base / "griffin", base / "target", tmp_path / "g")
    assert not (tmp_path / "g").exists()
