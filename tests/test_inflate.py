"""`vllm-moa inflate`: a widened target and its drafters compute the same functions.

Tolerance: fp32 throughout; the norms' rescaling and the wider sums round differently (observed
5e-7 at most on target logits below 1, 1e-7 on drafter outputs), so ATOL = RTOL = 1e-4 leave a
100x margin. Controls, each an inflate wrong in a plausible way (norms not rescaled, query heads
left in order instead of moved into their KV group, qwen2's q/k/v biases dropped or its q bias
not moved with its head), move some output by 0.011 (the q bias not moved) to 6.5, above
CONTROL_MARGIN and 60x the comparison's tolerance at least, so the same comparisons fail them.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_drafter, make_hf_model

from vllm_moa.checkpoint import inflate, save_drafter
from vllm_moa.checkpoint.inflate import Widening, inflate_drafter, inflate_target
from vllm_moa.checkpoint.io import load_drafter
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.drafters.independent.model import IndependentDrafter
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.drafters.presets import (
    TargetInfo,
    make_eagle3_config,
    make_eagle_config,
    make_independent_config,
)
from vllm_moa.hf_target import HFTarget

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

WIDE = dict(hidden=256, intermediate=640, heads=8)  # from E=128, MLP 256, 4 heads of 32
ATOL = RTOL = 1e-4
CONTROL_MARGIN = 50 * ATOL  # a control must move some output by at least this
QKV_BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")


def _random_biases(model: torch.nn.Module) -> None:
    """qwen2's q/k/v biases start at zero; values make their widening count."""
    gen = torch.Generator().manual_seed(2)
    biases = [p for n, p in model.named_parameters() if n.endswith(QKV_BIASES)]
    assert len(biases) == 3 * model.config.num_hidden_layers
    with torch.no_grad():
        for p in biases:
            p.copy_(torch.randn(p.shape, generator=gen))


def _target(tmp_path, arch: str, seed: int = 0):
    import transformers as tf

    model = make_hf_model(arch, num_heads=4, num_kv_heads=2, seed=seed)
    if arch == "qwen2":
        _random_biases(model)
    model.save_pretrained(tmp_path / "small")
    inflate_target(tmp_path / "small", tmp_path / "wide", **WIDE)
    wide = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "wide").eval()
    return model, wide


def _target_logits(tmp_path, arch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The small and the widened target's logits [2, 24, V] on the same random ids."""
    model, wide = _target(tmp_path, arch)
    assert wide.config.hidden_size == 256 and wide.config.num_attention_heads == 8
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits, wide(ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_inflated_target_has_the_same_logits(tmp_path, arch):
    want, got = _target_logits(tmp_path, arch)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def _dropping(suffixes: tuple[str, ...]):
    """widen_tensor with the tensors named `*suffixes` zeroed: a widening that loses them."""
    real = inflate.widen_tensor

    def widen(name: str, t: torch.Tensor, w: Widening) -> torch.Tensor:
        out = real(name, t, w)
        return torch.zeros_like(out) if name.endswith(suffixes) else out

    return widen


def _q_bias_padded():
    """widen_tensor that moves the q rows to their heads' new places but only pads the q bias."""
    real = inflate.widen_tensor

    def widen(name: str, t: torch.Tensor, w: Widening) -> torch.Tensor:
        if name.endswith("q_proj.bias"):
            return inflate._pad(t, (w.new_heads * w.head_dim,))
        return real(name, t, w)

    return widen


NORMS_NOT_RESCALED = [(Widening, "norm_scale", property(lambda w: 1.0))]
HEADS_IN_ORDER = [(Widening, "head_index", lambda w: torch.arange(w.heads))]
# name -> (arch, [(object, attribute, broken value)])
TARGET_CONTROLS = {
    "norms_not_rescaled": ("llama", NORMS_NOT_RESCALED),
    "heads_in_order": ("llama", HEADS_IN_ORDER),
    "qwen2_biases_dropped": ("qwen2", [(inflate, "widen_tensor", _dropping(QKV_BIASES))]),
    "qwen2_q_bias_dropped": ("qwen2", [(inflate, "widen_tensor", _dropping(QKV_BIASES[:1]))]),
    "qwen2_v_bias_dropped": ("qwen2", [(inflate, "widen_tensor", _dropping(QKV_BIASES[2:]))]),
    "qwen2_q_bias_not_moved": ("qwen2", [(inflate, "widen_tensor", _q_bias_padded())]),
}


@pytest.mark.parametrize("control", TARGET_CONTROLS)
def test_a_wrong_target_inflate_fails_the_logits_check(tmp_path, monkeypatch, control):
    """The controls of the test above: each broken widening moves some logit by more than
    CONTROL_MARGIN, far beyond its tolerance."""
    arch, patches = TARGET_CONTROLS[control]
    for owner, name, value in patches:
        monkeypatch.setattr(owner, name, value)
    want, got = _target_logits(tmp_path, arch)
    assert (got - want).abs().max() > CONTROL_MARGIN


def _small_drafters(small_t: HFTarget) -> dict[str, torch.nn.Module]:
    info = TargetInfo(small_t.shape, small_t.config.num_attention_heads)
    moa = make_drafter(small_t, tli=1, seed=1)
    # The presets give every drafter block one KV head, where any head order is right; with 2
    # the heads must move into their KV group, as the target's.
    moa_gqa = MoADrafter(moa.config.replace(sa_num_kv_heads=2, ca_num_kv_heads=2))
    moa_gqa.init_weights(7)
    drafters = {
        "moa": moa,
        "moa_gqa": moa_gqa.eval(),
        "eagle": EagleDrafter(make_eagle_config(info, "small")),
        "eagle3": Eagle3Drafter(make_eagle3_config(info, "small")),
        "independent": IndependentDrafter(make_independent_config(info, "small")),
    }
    drafters["eagle"].init_weights(2)
    drafters["eagle3"].init_weights(5, std=0.1)
    drafters["independent"].init_weights(3)
    return drafters


def _drafter_outputs(drafter, target: HFTarget, ids: torch.Tensor) -> list[torch.Tensor]:
    """What `drafter` computes on `target` for `ids` [1, T]: its output [1, T, E] and, for
    EAGLE-3, its own LM head's logits [1, T, V]."""
    target.reset()  # the target's cache holds nothing before ids
    out = target.forward(ids[0], (1, 2, 3))
    emb = target.embed(ids)
    with torch.no_grad():
        if isinstance(drafter, Eagle3Drafter):  # an EagleDrafter too: first
            feats = drafter.target_features({k: v[None] for k, v in out.hidden_states.items()})
            state = drafter(emb, feats)
            return [state, drafter.logits(state, lambda x: x)]
        if isinstance(drafter, EagleDrafter):
            return [drafter(emb, out.hidden_states[3][None])]
        if isinstance(drafter, IndependentDrafter):
            return [drafter(emb)]
        return [drafter(emb, out.layer_kv[None], torch.arange(ids.shape[1]))]  # MoA


def _widened_outputs(tmp_path, name, drafter, small_t, wide_t):
    """(the drafter's outputs on the small target, its widened copy's on the wide one)."""
    widening = inflate_target(tmp_path / "small", tmp_path / "wide2", **WIDE)
    small_dir = save_drafter(drafter, tmp_path / name)
    wide_dir = inflate_drafter(small_dir, tmp_path / f"{name}_wide", widening)
    wide_d = load_drafter(wide_dir, target=wide_t.shape)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    return _drafter_outputs(drafter, small_t, ids), _drafter_outputs(wide_d, wide_t, ids)


def test_inflated_drafters_compute_the_same(tmp_path):
    model, wide = _target(tmp_path, "llama")
    small_t, wide_t = HFTarget(model), HFTarget(wide)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out_s, out_w = small_t.forward(ids, (1, 2, 3)), wide_t.forward(ids, (1, 2, 3))
    torch.testing.assert_close(out_w.layer_kv, out_s.layer_kv, atol=1e-5, rtol=1e-5)
    for name, drafter in _small_drafters(small_t).items():
        wants, gots = _widened_outputs(tmp_path, name, drafter, small_t, wide_t)
        assert gots[0].shape[-1] == 256
        for want, got in zip(wants, gots, strict=True):  # the residual's first E columns
            width = want.shape[-1]
            torch.testing.assert_close(got[..., :width], want, atol=ATOL, rtol=RTOL)
            assert not got[..., width:].any()  # the new columns stay zero


@pytest.mark.parametrize(
    ("name", "control"),
    [
        ("moa", "norms_not_rescaled"),
        ("eagle3", "norms_not_rescaled"),
        ("moa_gqa", "heads_in_order"),
    ],
)
def test_a_wrong_drafter_inflate_fails_the_outputs_check(tmp_path, monkeypatch, name, control):
    """Controls of the test above: the target widened right, the drafter widened with its
    norms not rescaled or (2 KV heads) its heads left in order; its outputs move beyond the
    tolerance."""
    model, wide = _target(tmp_path, "llama")
    small_t, wide_t = HFTarget(model), HFTarget(wide)
    for owner, attribute, value in TARGET_CONTROLS[control][1]:
        monkeypatch.setattr(owner, attribute, value)
    drafter = _small_drafters(small_t)[name]
    wants, gots = _widened_outputs(tmp_path, name, drafter, small_t, wide_t)
    gap = max(
        float((g[..., : w.shape[-1]] - w).abs().max()) for w, g in zip(wants, gots, strict=True)
    )
    assert gap > CONTROL_MARGIN


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


def test_inflate_keeps_a_draft_vocabulary(tmp_path):
    """A MoA drafter's draft vocabulary (token ids, no width) is carried over as it is: the
    widened pair drafts and decodes the same."""
    model, wide = _target(tmp_path, "llama", seed=5)
    small_t, wide_t = HFTarget(model), HFTarget(wide)
    drafter = make_drafter(small_t, seed=6)
    drafter.set_draft_vocab_size(40)
    drafter.set_draft_vocab(torch.arange(3, 243, 6))
    widening = inflate_target(tmp_path / "small", tmp_path / "wide2", **WIDE)
    wide_dir = inflate_drafter(save_drafter(drafter, tmp_path / "moa"), tmp_path / "w", widening)
    wide_d = load_drafter(wide_dir, target=wide_t.shape)
    assert isinstance(wide_d, MoADrafter) and wide_d.draft_ids is not None
    assert wide_d.draft_ids.dtype == torch.int64
    assert torch.equal(wide_d.draft_ids, torch.arange(3, 243, 6))
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
