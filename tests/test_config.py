import dataclasses
import json

import pytest
import torch

from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.model.config import TargetShape
from vllm_moa.model.layers import count_parameters

LLAMA3_8B = TargetInfo(
    TargetShape(num_layers=32, hidden_size=4096, num_kv_heads=8, head_dim=128, vocab_size=128256),
    num_attention_heads=32,
    rope_theta=500000.0,
)
TINY = TargetInfo(TargetShape(3, 128, 1, 64, 256), num_attention_heads=2)


def test_paper_preset_matches_release_dims_and_size():
    c = make_config(LLAMA3_8B, "paper")
    assert (c.lsa_width, c.lsa_num_heads, c.lsa_num_kv_heads, c.lsa_intermediate_size) == (
        2048,
        32,
        8,
        3072,
    )
    assert (c.sa_num_heads, c.sa_num_kv_heads, c.sa_intermediate_size) == (32, 4, 6144)
    assert (c.ca_num_heads, c.ca_num_kv_heads, c.ca_intermediate_size) == (32, 4, 6144)
    with torch.device("meta"):
        counts = count_parameters(MoADrafter(c))
    # MOA_SPEC.md: about 264M trainable (LSA 29M, Ekv2E 8M, SA 113M, CA 113M).
    assert round(counts["layer_self_attention"] / 1e6) == 29
    assert round(counts["Ekv2E"] / 1e6) == 8
    assert round(counts["self_attention"] / 1e6) == 113
    assert round(counts["cross_attention"] / 1e6) == 113
    assert 260e6 < counts["total"] < 268e6


@pytest.mark.parametrize("preset", ["paper", "small"])
@pytest.mark.parametrize("tli", [0, 2])
def test_presets_build_valid_configs(preset, tli):
    c = make_config(TINY, preset, tli=tli)
    assert c.tli == tli and c.lsa_width == 128
    MoADrafter(c)  # constructs


def test_config_json_round_trip(tmp_path):
    c = make_config(LLAMA3_8B, "small", tli=1)
    c.save(tmp_path / "config.json")
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["architectures"] == ["MoADrafter"] and data["model_type"] == "moa_drafter"
    assert MoAConfig.load(tmp_path / "config.json") == c


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tli": 3}, r"0 <= tli < target_num_layers \(3\), got 3"),
        ({"tli": -1}, "tli"),
        ({"sa_num_heads": 3}, "sa_num_heads=3 must divide the SA width 128"),
        ({"ca_num_kv_heads": 3}, "ca_num_kv_heads=3 must divide ca_num_heads=2"),
        ({"lsa_num_heads": 0}, "lsa_num_heads must be > 0"),
        ({"vocab_size": 1.5}, "vocab_size must be an int"),
        ({"lsa_num_heads": 128}, "head size 1 .* must be even"),
    ],
)
def test_config_validation_names_the_field(change, message):
    c = make_config(TINY, "small")
    with pytest.raises((ValueError, TypeError), match=message):
        dataclasses.replace(c, **change)


def test_config_from_dict_errors():
    d = make_config(TINY, "small").to_dict()
    with pytest.raises(ValueError, match="unknown MoAConfig keys"):
        MoAConfig.from_dict({**d, "lsa_num_head": 2})
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        MoAConfig.from_dict({**d, "model_type": "llama"})
    with pytest.raises(ValueError, match=r"missing required keys \['vocab_size'\]"):
        MoAConfig.from_dict({k: v for k, v in d.items() if k != "vocab_size"})


def test_check_target_names_both_values():
    c = make_config(TINY, "small")
    with pytest.raises(ValueError, match="vocab size 256, but the target has 300"):
        c.check_target(dataclasses.replace(c.target_shape, vocab_size=300))
    with pytest.raises(ValueError, match="layer count 3, but the target has 4"):
        c.check_target(dataclasses.replace(c.target_shape, num_layers=4))
    with pytest.raises(
        ValueError, match=r"KV width \(num_kv_heads \* head_dim\) 64, but the target has 128"
    ):
        c.check_target(dataclasses.replace(c.target_shape, num_kv_heads=2))
