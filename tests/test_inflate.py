"""`vllm-moa inflate`: a widened target and its drafters compute the same functions."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_drafter, make_hf_model

from vllm_moa.checkpoint import save_drafter
from vllm_moa.checkpoint.inflate import inflate_drafter, inflate_target
from vllm_moa.checkpoint.io import load_drafter
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.drafters.independent.model import IndependentDrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.drafters.presets import (
    TargetInfo,
    make_eagle3_config,
    make_eagle_config,
    make_independent_config,
)
from vllm_moa.hf_target import HFTarget

WIDE = dict(hidden=256, intermediate=640, heads=8)  # from E=128, MLP 256, 4 heads of 32


def _target(tmp_path, arch: str, seed: int = 0):
    import transformers as tf

    model = make_hf_model(arch, num_heads=4, num_kv_heads=2, seed=seed)
    model.save_pretrained(tmp_path / "small")
    inflate_target(tmp_path / "small", tmp_path / "wide", **WIDE)
    wide = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "wide").eval()
    return model, wide


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_inflated_target_has_the_same_logits(tmp_path, arch):
    model, wide = _target(tmp_path, arch)
    if arch == "qwen2":  # give the q/k/v biases values, so their placement is checked
        assert any(n.endswith("q_proj.bias") for n, _ in model.named_parameters())
    assert wide.config.hidden_size == 256 and wide.config.num_attention_heads == 8
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids).logits, wide(ids).logits
    # fp32 throughout; the norms' rescaling and the wider sums round differently (~1e-6).
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_inflated_drafters_compute_the_same(tmp_path):
    model, wide = _target(tmp_path, "llama")
    small_t, wide_t = HFTarget(model), HFTarget(wide)
    info = TargetInfo(small_t.shape, model.config.num_attention_heads)
    drafters = {
        "moa": make_drafter(small_t, tli=1, seed=1),
        "eagle": EagleDrafter(make_eagle_config(info, "small")),
        "eagle3": Eagle3Drafter(make_eagle3_config(info, "small")),
        "independent": IndependentDrafter(make_independent_config(info, "small")),
    }
    drafters["eagle"].init_weights(2)
    drafters["eagle3"].init_weights(5, std=0.1)
    drafters["independent"].init_weights(3)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        layers = (1, 2, 3)
        out_s, out_w = small_t.forward(ids[0], layers), wide_t.forward(ids[0], layers)
    emb_s, emb_w = small_t.embed(ids), wide_t.embed(ids)
    torch.testing.assert_close(out_w.layer_kv, out_s.layer_kv, atol=1e-5, rtol=1e-5)
    widening = inflate_target(tmp_path / "small", tmp_path / "wide2", **WIDE)
    for name, drafter in drafters.items():
        small_dir = save_drafter(drafter, tmp_path / name)
        wide_dir = inflate_drafter(small_dir, tmp_path / f"{name}_wide", widening)
        wide_d = load_drafter(wide_dir, target=wide_t.shape)
        with torch.no_grad():
            if name == "moa":
                limit = torch.arange(20)
                want = drafter(emb_s, out_s.layer_kv[None], limit)
                got = wide_d(emb_w, out_w.layer_kv[None], limit)
            elif name == "eagle":
                want = drafter(emb_s, out_s.hidden_states[3][None])
                got = wide_d(emb_w, out_w.hidden_states[3][None])
            elif name == "eagle3":  # the layer's output, and its own LM head's logits
                feats_s = drafter.target_features(
                    {k: v[None] for k, v in out_s.hidden_states.items()}
                )
                feats_w = wide_d.target_features(
                    {k: v[None] for k, v in out_w.hidden_states.items()}
                )
                want, got = drafter(emb_s, feats_s), wide_d(emb_w, feats_w)
                logits_w = wide_d.logits(got, lambda x: x)
                torch.testing.assert_close(
                    logits_w, drafter.logits(want, lambda x: x), atol=1e-4, rtol=1e-4
                )
            else:
                want, got = drafter(emb_s), wide_d(emb_w)
        assert got.shape[-1] == 256
        torch.testing.assert_close(got[..., :128], want, atol=1e-4, rtol=1e-4)
        assert got[..., 128:].abs().max() == 0


def test_inflated_pair_drafts_and_decodes_the_same(tmp_path):
    """The standalone engine with MoA TLI=1: same tokens and the same accepted drafts."""
    model, wide = _target(tmp_path, "llama", seed=5)
    small_t, wide_t = HFTarget(model), HFTarget(wide)
    drafter = make_drafter(small_t, tli=1, seed=6)
    widening = inflate_target(tmp_path / "small", tmp_path / "wide2", **WIDE)
    wide_dir = inflate_drafter(save_drafter(drafter, tmp_path / "moa"), tmp_path / "w", widening)
    wide_d = load_drafter(wide_dir, target=wide_t.shape)
    prompt = list(range(5, 25))
    want = SpeculativeEngine(small_t, MoAProposer(drafter, small_t)).generate(prompt, 24)
    got = SpeculativeEngine(wide_t, MoAProposer(wide_d, wide_t)).generate(prompt, 24)
    assert got.token_ids == want.token_ids
    assert got.stats.accepted_per_position == want.stats.accepted_per_position


def test_inflate_errors_are_clear(tmp_path):
    model = make_hf_model("llama", num_heads=4, num_kv_heads=2)
    model.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        inflate_target(tmp_path / "small", tmp_path / "x", hidden=256, intermediate=512, heads=7)
    with pytest.raises(ValueError, match="only widens"):
        inflate_target(tmp_path / "small", tmp_path / "x", hidden=64, intermediate=512, heads=8)
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    config["model_type"] = "gemma"
    (tmp_path / "small" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="this one is 'gemma'"):
        inflate_target(tmp_path / "small", tmp_path / "x", hidden=256, intermediate=512, heads=8)
