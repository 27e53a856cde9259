"""The target's RoPE scaling in the MoA drafter: applied in Self-Attention only, as the authors'
training code does (CA and LSA plain), by transformers' own frequency functions.

(a) SA's rotary equals transformers' LlamaRotaryEmbedding of a rope-scaled target's config past
its original_max_position_embeddings; (b) without scaling the drafter computes what it did before
the field existed, bit for bit; (c) greedy speculative decoding on a rope-scaled target equals
plain greedy, and the proposer's drafts equal the full-sequence forward at long positions; (d) the
control: the same weights without the scaling give other SA outputs there; (e) convert-official
records a release's scaling, and a drafter is refused for a target with another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import OracleMoAProposer, make_hf_model
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from vllm_moa.checkpoint import ConvertOptions, convert_official, load_drafter, save_drafter
from vllm_moa.checkpoint.validate import DrafterCheckError, check_drafter_dir
from vllm_moa.decoding import SamplingParams, SpeculativeEngine
from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.hf_target import HFTarget
from vllm_moa.hf_target.info import load_target_info, rope_theta_of
from vllm_moa.model.layers import Attention
from vllm_moa.model.rope import rope_cos_sin

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

ORIGINAL = 16  # the tiny targets' pretraining length: scaling matters past it
THETA = 500000.0  # Llama-3's base
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
}
SCALINGS = {
    "llama3": LLAMA3,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}
POSITIONS = torch.arange(8 * ORIGINAL)  # up to 8x the original length
# cos/sin: both sides multiply a position by the same float32 frequency (transformers' function
# computes it for both) and take cos/sin in float32: identical today (observed 0). The margin
# allows another operation order in a later transformers: one ulp of an argument up to 128 rad
# is 7.6e-6.
ROTARY_ATOL = 2e-5
# Drafts against the full-sequence forward, float32 tiny models: summation order only (as in
# tests/test_moa_incremental.py).
TOL = dict(atol=1e-4, rtol=1e-4)
CONTROL_MARGIN = 100 * TOL["atol"]  # a control must move some value by at least this
DATA = Path(__file__).parent / "data" / "official"


def _scaled_model(kind: str = "llama3", seed: int = 0):
    return make_hf_model(
        "llama", seed=seed, rope_parameters={"rope_theta": THETA, **SCALINGS[kind]}
    )


@pytest.fixture(scope="module")
def scaled_target() -> HFTarget:
    return HFTarget(_scaled_model())


def make_drafter(target: HFTarget, tli: int = 0, seed: int = 0) -> MoADrafter:
    """A random `small` MoA drafter for `target`, sized as `vllm-moa init-drafter` sizes it (with
    the target's RoPE base and scaling). Weights of std 0.1, not the usual 0.02: attention sharp
    enough that positions move the logits (a control below moves them by ~1, 0.0003 at 0.02)."""
    info = TargetInfo(target.shape, target.config.num_attention_heads, rope_theta_of(target.config))
    drafter = MoADrafter(make_config(info, preset="small", tli=tli))
    drafter.init_weights(seed, std=0.1)
    return drafter.eval()


def _blocks(drafter: MoADrafter) -> tuple[Attention, Attention, Attention]:
    """SA, CA, LSA attention modules."""
    d = drafter
    return (
        d.self_attention.self_attn,
        d.cross_attention.self_attn,
        d.layer_self_attention.self_attn,
    )


def _with(drafter: MoADrafter, **changes) -> MoADrafter:
    """The same weights under a changed configuration."""
    other = MoADrafter(drafter.config.replace(**changes))
    other.load_state_dict(drafter.state_dict())
    return other.eval()


# (a) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_sa_rotary_equals_transformers(kind):
    model = _scaled_model(kind)
    target = HFTarget(model)
    drafter = make_drafter(target)
    assert drafter.config.sa_rope_scaling == target.shape.rope_scaling  # make_config took it
    assert target.shape.rope_scaling["rope_type"] == kind
    sa, ca, lsa = _blocks(drafter)
    assert sa.head_dim == target.shape.head_dim  # the comparison below is head for head
    hf_cos, hf_sin = model.model.rotary_emb(torch.zeros(1), POSITIONS[None])  # [1, S, D]
    cos, sin = sa.cos_sin(POSITIONS, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], atol=ROTARY_ATOL, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=ROTARY_ATOL, rtol=0)
    # The rotated queries, against transformers' own apply_rotary_pos_emb.
    x = torch.randn(
        1, len(POSITIONS), target.shape.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        q = sa.project_q(x, POSITIONS)
        raw = sa.q_proj(x).unflatten(-1, (sa.num_heads, sa.head_dim)).transpose(1, 2)
        hf_q, _ = apply_rotary_pos_emb(raw, raw, hf_cos, hf_sin)
    torch.testing.assert_close(q, hf_q, atol=1e-5, rtol=1e-5)
    # CA and LSA stay plain, as the authors' training code builds them.
    assert ca.rope_scaling is None and lsa.rope_scaling is None
    plain = rope_cos_sin(POSITIONS, ca.head_dim, ca.rope_theta, torch.float32)
    assert all(
        torch.equal(a, b) for a, b in zip(ca.cos_sin(POSITIONS, torch.float32), plain, strict=True)
    )
    # The control: plain RoPE is far from the scaled target's past the original length.
    unscaled, _ = rope_cos_sin(POSITIONS, sa.head_dim, THETA, torch.float32)
    assert (unscaled - hf_cos[0])[ORIGINAL:].abs().max() > 0.1


def test_frequencies_survive_bfloat16_and_stay_out_of_the_checkpoint(scaled_target):
    drafter = make_drafter(scaled_target)
    sa = drafter.self_attention.self_attn
    cos32, sin32 = sa.cos_sin(POSITIONS, torch.float32)
    drafter.to(torch.bfloat16)
    cos16, sin16 = sa.cos_sin(POSITIONS, torch.bfloat16)
    assert torch.equal(cos16, cos32.to(torch.bfloat16)) and torch.equal(
        sin16, sin32.to(torch.bfloat16)
    )
    assert not any("rope" in name for name in drafter.state_dict())


# (b) ---------------------------------------------------------------------------------------


def _cos_sin_before(positions, head_dim, theta, dtype):
    """model/layers.py's rope_cos_sin at commit 69ebe4a, before RoPE scaling, verbatim."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def test_without_scaling_the_drafter_is_unchanged(llama_target, monkeypatch):
    drafter = make_drafter(llama_target, tli=1, seed=1)
    assert llama_target.shape.rope_scaling is None and drafter.config.sa_rope_scaling is None
    data = drafter.config.to_dict()
    del data["sa_rope_scaling"]  # a config.json written before the field existed
    assert MoAConfig.from_dict(data) == drafter.config
    for attn in _blocks(drafter):
        assert attn.rope_scaling is None and not hasattr(attn, "rope_inv_freq_bits")
        now, before = (
            attn.cos_sin(POSITIONS, torch.float32),
            _cos_sin_before(POSITIONS, attn.head_dim, attn.rope_theta, torch.float32),
        )
        assert all(torch.equal(a, b) for a, b in zip(now, before, strict=True))
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(1))
    llama_target.reset()
    features = llama_target.forward(ids).layer_kv[None]
    limit = torch.arange(50).clamp(max=30) + 1
    with torch.no_grad():
        now = drafter(llama_target.embed(ids)[None], features, limit)
        monkeypatch.setattr(
            Attention,
            "cos_sin",
            lambda self, p, dtype: _cos_sin_before(p, self.head_dim, self.rope_theta, dtype),
        )
        before = drafter(llama_target.embed(ids)[None], features, limit)
    assert torch.equal(now, before)


# (c) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tli", [0, 1])
def test_greedy_equality_on_a_rope_scaled_target(scaled_target, tli):
    drafter = make_drafter(scaled_target, tli=tli, seed=tli)
    prompt = list(range(7, 7 + ORIGINAL + 4))  # drafting starts past the original length
    plain = SpeculativeEngine(scaled_target).generate(prompt, 28).token_ids
    accepted = 0
    for proposer in (
        MoAProposer(drafter, scaled_target),
        OracleMoAProposer(drafter, scaled_target),
    ):
        result = SpeculativeEngine(scaled_target, proposer).generate(
            prompt, 28, num_speculative_tokens=4
        )
        assert result.token_ids == plain
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0  # the oracle's drafts are accepted: both engine branches ran


def _long_sequence() -> tuple[torch.Tensor, int]:
    """T = 4 x ORIGINAL token ids and P = 2 x ORIGINAL verified ones."""
    return torch.randint(0, 256, (4 * ORIGINAL,), generator=torch.Generator().manual_seed(2)), 32


def _full_forward(drafter: MoADrafter, target: HFTarget) -> torch.Tensor:
    """TLI 0 logits [T - P, V] of the full-sequence forward (training's path) for rows P..T-1,
    each seeing the memory of the P verified tokens."""
    ids, p = _long_sequence()
    target.reset()
    features = target.forward(ids).layer_kv[None]
    limit = torch.arange(len(ids)).clamp(max=p - 1) + 1
    with torch.no_grad():
        return target.lm_logits(drafter(target.embed(ids)[None], features, limit)[0])[p:]


def test_drafts_equal_the_full_forward_at_long_positions(scaled_target):
    """The proposer (inference's path: SA's KV cache, one position per step) drafts rows
    P..T-1 after P verified tokens, teacher-forced, all past the original length."""
    drafter = make_drafter(scaled_target, seed=3)
    ids, p = _long_sequence()
    scaled_target.reset()
    proposer = MoAProposer(drafter, scaled_target)
    proposer.start(ids[:p].tolist(), scaled_target.forward(ids[:p]))
    forced = ids[p + 1 :].tolist()
    drafted = proposer.propose(int(ids[p]), len(ids) - p, SamplingParams(), None, forced=forced)
    torch.testing.assert_close(drafted.logits, _full_forward(drafter, scaled_target), **TOL)
    # (d) the control: the same weights without the scaling give other logits.
    unscaled = _full_forward(_with(drafter, sa_rope_scaling=None), scaled_target)
    assert (unscaled - drafted.logits).abs().max() > CONTROL_MARGIN


# (d) ---------------------------------------------------------------------------------------


def test_dropping_the_scaling_moves_sa_outputs_at_long_positions(scaled_target):
    drafter = make_drafter(scaled_target, seed=4)
    plain = _with(drafter, sa_rope_scaling=None)
    ids = torch.randint(0, 256, (8 * ORIGINAL,), generator=torch.Generator().manual_seed(4))
    x = scaled_target.embed(ids)[None]
    outs = []
    with torch.no_grad():
        for d in (drafter, plain):
            k, v = d.self_attention.kv_from(x, POSITIONS)
            causal = POSITIONS[:, None] >= POSITIONS[None, :]
            outs.append(d.self_attention(x, POSITIONS, k, v, causal)[0])
    assert (outs[0] - outs[1])[ORIGINAL:].abs().max() > CONTROL_MARGIN


# (e) and the config ------------------------------------------------------------------------


def test_config_round_trip_and_validation(tmp_path, scaled_target):
    drafter = make_drafter(scaled_target)
    path = save_drafter(drafter, tmp_path / "d")
    assert json.loads((path / "config.json").read_text())["sa_rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": ORIGINAL,
    }
    assert check_drafter_dir(path, scaled_target.shape) == drafter.config
    loaded = load_drafter(path, target=scaled_target.shape)
    assert loaded.config == drafter.config
    cos = loaded.self_attention.self_attn.cos_sin(POSITIONS, torch.float32)[0]
    assert torch.equal(cos, drafter.self_attention.self_attn.cos_sin(POSITIONS, torch.float32)[0])
    c = drafter.config
    with pytest.raises(ValueError, match=r"sa_rope_scaling must be a dict with rope_type one of"):
        c.replace(sa_rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"sa_rope_scaling .* not valid for transformers"):
        c.replace(
            sa_rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 8,
            }
        )
    with pytest.raises(ValueError, match=r"must not hold rope_theta"):
        c.replace(sa_rope_scaling={**LLAMA3, "rope_theta": THETA})


def test_a_drafter_is_refused_for_a_target_with_other_scaling(
    tmp_path, scaled_target, llama_target
):
    scaled = save_drafter(make_drafter(scaled_target), tmp_path / "scaled")
    plain = save_drafter(make_drafter(llama_target), tmp_path / "plain")
    message = r"Self-Attention applies RoPE scaling .* but the target's is"
    with pytest.raises(ValueError, match=message + r" None"):
        load_drafter(scaled, target=llama_target.shape)
    # A drafter recording no scaling runs its SA unscaled, as trained (older drafters): accepted.
    assert load_drafter(plain, target=scaled_target.shape).config.sa_rope_scaling is None
    with pytest.raises(DrafterCheckError, match=message) as err:
        check_drafter_dir(scaled, llama_target.shape)
    assert "\n" not in str(err.value)
    other = HFTarget(
        make_hf_model("llama", rope_parameters={"rope_theta": THETA, **LLAMA3, "factor": 4.0})
    )
    with pytest.raises(ValueError, match=r"'factor': 8.0.* but the target's is .*'factor': 4.0"):
        MoAProposer(load_drafter(scaled), other)


def _scaled_copy(src: Path, dst: Path, scaling: dict) -> Path:
    """A copy of a release (or target) directory whose config.json sets `rope_scaling`, as a
    Llama-3.1 config.json does (transformers 4 spelling, the authors' pinned version)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["rope_scaling"] = scaling
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_convert_official_records_the_scaling_for_sa(tmp_path):
    """Training layout (the target's Llama config with rope_scaling) converts alone; the moa_spec
    layout against a rope-scaled --target. Their SA is a LlamaDecoderLayer on that config: its
    rotary is transformers' LlamaRotaryEmbedding of it, which the converted SA must equal."""
    scaling = {**LLAMA3, "original_max_position_embeddings": 32}  # the fixtures' max is 64
    release = _scaled_copy(DATA / "lsa64" / "release_training", tmp_path / "rel", scaling)
    out = convert_official(release, tmp_path / "out", ConvertOptions(tli=0))
    drafter = load_drafter(out)
    assert drafter.config.sa_rope_scaling == {k: scaling[k] for k in sorted(scaling)}
    sa, ca, lsa = _blocks(drafter)
    assert ca.rope_scaling is None and lsa.rope_scaling is None
    theirs = LlamaRotaryEmbedding(LlamaConfig.from_pretrained(release))
    hf_cos, hf_sin = theirs(torch.zeros(1), POSITIONS[None])
    cos, sin = sa.cos_sin(POSITIONS, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], atol=ROTARY_ATOL, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=ROTARY_ATOL, rtol=0)

    target_dir = _scaled_copy(DATA / "lsa64" / "target", tmp_path / "target", scaling)
    spec = _scaled_copy(DATA / "lsa64" / "release_moa_spec", tmp_path / "spec", scaling)
    options = ConvertOptions(tli=1, target=load_target_info(target_dir))
    converted = load_drafter(convert_official(spec, tmp_path / "out2", options))
    assert converted.config.sa_rope_scaling == drafter.config.sa_rope_scaling
    target = HFTarget.from_pretrained(target_dir)
    MoAProposer(converted.float(), target)  # accepted: the same scaling
    plain = HFTarget.from_pretrained(DATA / "lsa64" / "target")
    with pytest.raises(ValueError, match=r"RoPE scaling .* but the target's is None"):
        MoAProposer(converted.float(), plain)


@pytest.mark.parametrize(
    ("scaling", "target_scaled", "message"),
    [
        (LLAMA3, False, r"has RoPE scaling \{'rope_type': 'llama3'.* but the target has None"),
        (None, True, r"has RoPE scaling None but the target has \{'rope_type': 'llama3'"),
        ({"rope_type": "dynamic", "factor": 2.0}, False, r"'dynamic' and 'longrope' change"),
        (
            {"rope_type": "llama3", "factor": 8.0},
            False,
            r"RoPE scaling .* not valid for transformers",
        ),
    ],
)
def test_convert_official_refusals(tmp_path, scaling, target_scaled, message):
    spec = _scaled_copy(DATA / "lsa64" / "release_moa_spec", tmp_path / "spec", scaling)
    target_dir = DATA / "lsa64" / "target"
    if target_scaled:
        target_dir = _scaled_copy(target_dir, tmp_path / "target", LLAMA3)
    options = ConvertOptions(tli=0, target=load_target_info(target_dir))
    with pytest.raises(ValueError, match=message):
        convert_official(spec, tmp_path / "o", options)


def test_legacy_rope_scaling_spelling_is_recorded_as_rope_type(tmp_path):
    """Older configs spell the type `type`; the drafter records transformers' `rope_type`."""
    release = _scaled_copy(
        DATA / "lsa64" / "release_training", tmp_path / "rel", {"type": "linear", "factor": 2.0}
    )
    out = convert_official(release, tmp_path / "out", ConvertOptions(tli=0))
    assert load_drafter(out).config.sa_rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_vllm_target_view_reads_the_same_scaling(scaled_target):
    """Inside vLLM the target's facts come from its hf_text_config (vllm_plugin/target_view.py):
    the scaling read there is the one the standalone target reports, so a drafter made here for
    the target passes the plugin's load-time check. A stub stands in for vLLM's model."""
    from torch import nn

    from vllm_moa.vllm_plugin.target_view import VllmTargetView

    class Layer(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.self_attn = nn.Module()
            self.self_attn.attn = nn.Module()
            self.self_attn.attn.layer_name = f"model.layers.{i}.self_attn.attn"

    stub = nn.Module()
    stub.model = nn.Module()
    stub.model.layers = nn.ModuleList(Layer(i) for i in range(scaled_target.shape.num_layers))
    stub.compute_logits = lambda hidden: hidden
    view = VllmTargetView(stub, scaled_target.config)
    assert view.shape == scaled_target.shape and view.shape.rope_scaling["rope_type"] == "llama3"
    make_drafter(scaled_target).config.check_target(view.shape)


def test_a_drafter_sized_from_a_target_directory_records_its_scaling(tmp_path, scaled_target):
    """`vllm-moa init-drafter` and `vllm-moa train` size the drafter from the target's
    directory (load_target_info, then make_config)."""
    scaled_target.model.config.save_pretrained(tmp_path)
    info = load_target_info(tmp_path)
    assert info.shape == scaled_target.shape and info.rope_theta == THETA
    assert make_config(info, "small").sa_rope_scaling == scaled_target.shape.rope_scaling
