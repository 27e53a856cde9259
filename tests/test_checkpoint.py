import json

import pytest
import torch
from conftest import make_drafter
from safetensors.torch import save_file

from vllm_moa.checkpoint import ConvertOptions, convert_official, load_drafter, save_drafter
from vllm_moa.checkpoint.io import WEIGHTS_NAME


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_load_round_trip_holds_only_drafter_weights(tmp_path, llama_target):
    drafter = make_drafter(llama_target, tli=1, seed=3)
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["MoADrafter"] and config["tli"] == 1
    loaded = load_drafter(tmp_path / "d", target=llama_target.shape)
    assert loaded.config == drafter.config and _same_weights(loaded, drafter)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / WEIGHTS_NAME), "pt") as f:
        keys = list(f.keys())
    assert not [k for k in keys if "embed" in k or "lm_head" in k]
    assert {k.split(".")[0] for k in keys} == {
        "layer_self_attention",
        "Ekv2E",
        "self_attention",
        "cross_attention",
    }


def test_load_errors(tmp_path, llama_target):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no drafter config"):
        load_drafter(tmp_path / "empty")
    d = save_drafter(make_drafter(llama_target), tmp_path / "d")
    (d / WEIGHTS_NAME).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(
        ValueError, match=r"truncated or not a safetensors file .*: a corrupt or incomplete copy"
    ):
        load_drafter(d)
    d = save_drafter(make_drafter(llama_target), tmp_path / "d2")
    save_file({"Ekv2E.weight": torch.zeros(2, 2)}, str(d / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="does not match its config: missing"):
        load_drafter(d)


def test_load_refuses_another_target(tmp_path, llama_target):
    from dataclasses import replace

    d = save_drafter(make_drafter(llama_target), tmp_path / "d")
    with pytest.raises(ValueError, match="hidden size 128, but the target has 256"):
        load_drafter(d, target=replace(llama_target.shape, hidden_size=256))


def _write_official(src, drafter, target_config, prefix=""):
    """A synthetic checkpoint in the authors' release layout: target-style config + keys."""
    src.mkdir()
    (src / "config.json").write_text(json.dumps(target_config))
    state = {
        prefix + k.replace("cross_attention.self_attn.", "cross_attention.cross_attn."): v
        for k, v in drafter.state_dict().items()
    }
    state["embed_tokens.weight"] = torch.zeros(4, 4)  # shared target weight: must be dropped
    half = len(state) // 2
    items = sorted(state.items())
    save_file(dict(items[:half]), str(src / "model-00001-of-00002.safetensors"))
    save_file(dict(items[half:]), str(src / "model-00002-of-00002.safetensors"))


@pytest.mark.parametrize("prefix", ["", "model."])
def test_convert_official_layout(tmp_path, llama_target, prefix):
    drafter = make_drafter(llama_target, tli=1, seed=7, preset="paper")
    target_config = llama_target.config.to_dict() | {"tli": 1}
    _write_official(tmp_path / "src", drafter, target_config, prefix)
    # The LSA head size 64 is the release's; the tiny target's head_dim is 64 too.
    out = convert_official(tmp_path / "src", tmp_path / "dst", ConvertOptions())
    loaded = load_drafter(out, target=llama_target.shape)
    assert loaded.config.tli == 1
    assert loaded.config.sa_num_heads == drafter.config.sa_num_heads
    assert loaded.config.lsa_num_kv_heads == drafter.config.lsa_num_kv_heads
    assert _same_weights(loaded, drafter)


def test_convert_official_errors(tmp_path, llama_target):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_official(tmp_path / "missing", tmp_path / "out")
    drafter = make_drafter(llama_target)
    bad = llama_target.config.to_dict() | {"num_key_value_heads": 2}
    _write_official(tmp_path / "src", drafter, bad)
    with pytest.raises(ValueError, match=r"Ekv2E takes 128 inputs but the target's 2\*E_kv is 256"):
        convert_official(tmp_path / "src", tmp_path / "out")


def test_griffin_round_trip_and_validation(tmp_path, llama_target):
    """A GRIFFIN drafter saves its fusion and two-headed layer, loads back to the same weights,
    passes the server-side check, and is recognised as its own kind."""
    from vllm_moa.checkpoint.validate import check_drafter_dir
    from vllm_moa.drafters.griffin.model import GriffinDrafter
    from vllm_moa.drafters.presets import TargetInfo, make_griffin_config
    from vllm_moa.kinds import kind_of

    info = TargetInfo(llama_target.shape, llama_target.config.num_attention_heads)
    drafter = GriffinDrafter(make_griffin_config(info, "small"))
    drafter.init_weights(4)
    save_drafter(drafter, tmp_path / "g")
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    assert config["model_type"] == "griffin_drafter" and config["tgf_intermediate_size"] > 0
    assert check_drafter_dir(tmp_path / "g", llama_target.shape) == drafter.config
    loaded = load_drafter(tmp_path / "g", target=llama_target.shape)
    assert type(loaded) is GriffinDrafter and kind_of(loaded).name == "griffin"
    assert loaded.config == drafter.config and _same_weights(loaded, drafter)
    assert {k.split(".")[0] for k in loaded.state_dict()} == {"fc", "tgf", "layer"}
