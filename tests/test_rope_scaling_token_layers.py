"""The target's RoPE scaling in the token-layer drafters (EAGLE, GRIFFIN, EAGLE-3, independent):
applied in every attention of the drafter, as the EAGLE-3 authors' cnets.py and vLLM's
llama_eagle3.py apply the target's `rope_scaling` to the draft layer (MoA's SA:
tests/test_rope_scaling.py).

For each kind, on a llama3-scaled tiny target: (a) the preset records the target's scaling and
every attention rotates as transformers' LlamaRotaryEmbedding of the target (control: plain RoPE
is far from it past the original length); (b) greedy speculative output equals plain decoding,
drafts landing, past the original length; (c) the control that the scaling reaches the drafts:
the same weights with plain RoPE give other draft logits at long positions; (d) save / load keeps
the field, a config.json without it loads unscaled and runs on any target, a drafter recording a
scaling is refused for a target with another, in one line; (e) `export-eagle` writes the scaling
where transformers and vLLM read it: the exported EAGLE layer in transformers' LlamaModel equals
our drafter at long positions (control: the previous export's unscaled config does not), and
EAGLE-3's export rotates as our layer. vLLM's own reading of the export:
tests/vllm_integration/test_vllm_eagle.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file
from test_baselines import KINDS, PROPOSERS
from test_rope_scaling import LLAMA3, ORIGINAL, THETA

from vllm_moa.checkpoint import load_drafter, save_drafter
from vllm_moa.checkpoint.validate import DrafterCheckError, check_drafter_dir
from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle
from vllm_moa.decoding import SamplingParams, SpeculativeEngine
from vllm_moa.drafters.token_layers import TokenLayerConfig
from vllm_moa.hf_target import HFTarget, load_target_info
from vllm_moa.kinds import BY_NAME
from vllm_moa.model.layers import Attention
from vllm_moa.model.rope import rope_cos_sin

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

ORIGINAL_LENGTH = {"original_max_position_embeddings": ORIGINAL}
VOCAB = 12  # small, so random drafts are often right and the acceptance paths run
POSITIONS = torch.arange(8 * ORIGINAL)
# As tests/test_rope_scaling.py: the same float32 frequencies on both sides (observed 0); the
# margin allows another operation order, one ulp of an argument up to 128 rad being 7.6e-6.
ROTARY_ATOL = 2e-5
# A control must move some logit by at least this: 100x the float32 tolerance the drafts are
# compared at elsewhere (tests/test_baselines.py, 1e-4).
CONTROL_MARGIN = 1e-2


def _scaled_hf(vocab: int = VOCAB, factor: float = 8.0):
    rope = {**LLAMA3, "factor": factor, "rope_theta": THETA}
    return make_hf_model("llama", vocab_size=vocab, seed=5, rope_parameters=rope)


@pytest.fixture(scope="module")
def scaled_model():
    return _scaled_hf()


@pytest.fixture(scope="module")
def scaled_target(scaled_model) -> HFTarget:
    return HFTarget(scaled_model)


def make_drafter(kind: str, target: HFTarget, seed: int = 0, **changes):
    """A random `small` drafter of `kind` for `target`, sized by the kind's preset as `train`
    sizes it (the target's base and scaling); `changes` override config fields. Weights of std
    0.1: attention sharp enough that positions move the logits."""
    from vllm_moa.drafters.presets import TargetInfo
    from vllm_moa.hf_target.info import rope_theta_of

    kind_ = BY_NAME[kind]
    info = TargetInfo(target.shape, target.config.num_attention_heads, rope_theta_of(target.config))
    config = kind_.load("sizing")(info, "small").replace(**changes)
    drafter = kind_.load("module")(config)
    drafter.init_weights(seed, std=0.1)
    return drafter.eval()


def _attentions(drafter) -> list[Attention]:
    return [m for m in drafter.modules() if isinstance(m, Attention)]


# (a) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_attention_rotates_as_the_target(kind, scaled_model, scaled_target):
    drafter = make_drafter(kind, scaled_target)
    assert drafter.config.rope_scaling == scaled_target.shape.rope_scaling == LLAMA3
    hf_cos, hf_sin = scaled_model.model.rotary_emb(torch.zeros(1), POSITIONS[None])  # [1, S, D]
    attentions = _attentions(drafter)
    assert len(attentions) == (2 if kind == "independent" else 1)
    for attn in attentions:
        assert attn.head_dim == scaled_target.shape.head_dim  # head for head with the target
        cos, sin = attn.cos_sin(POSITIONS, torch.float32)
        torch.testing.assert_close(cos, hf_cos[0], atol=ROTARY_ATOL, rtol=0)
        torch.testing.assert_close(sin, hf_sin[0], atol=ROTARY_ATOL, rtol=0)
    # The control: plain RoPE (what these drafters applied before) is far from it there.
    plain, _ = rope_cos_sin(POSITIONS, attentions[0].head_dim, THETA, torch.float32)
    assert (plain - hf_cos[0])[ORIGINAL:].abs().max() > 0.1


# (b) ---------------------------------------------------------------------------------------


def _oracle(kind: str):
    """The kind's real proposer, its chains forced (`forced`, teacher forcing) along the target's
    greedy continuation for their first j tokens, j = the context length mod K + 1 (0..K): every
    path of the drafter runs on its own features and caches, and drafts land in part and in
    full (random drafters alone land none here)."""

    class Oracle(PROPOSERS[kind]):
        @torch.no_grad()
        def propose(self, last_token, num_tokens, params, gen, forced=()):
            ids = [*self.tokens, last_token]
            for _ in range(len(ids) % (num_tokens + 1)):
                logits = self.target.model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            forced = ids[len(self.tokens) + 1 :]
            return super().propose(last_token, num_tokens, params, gen, forced=forced)

    return Oracle


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equality_on_a_rope_scaled_target(kind, scaled_target):
    """Prompts longer than the original length: every draft sits where the scaling matters."""
    drafter = make_drafter(kind, scaled_target, seed=1)
    proposer = _oracle(kind)(drafter, scaled_target)
    accepted = rejected = 0
    for start in (0, 5):
        prompt = [(start + 7 * i) % VOCAB for i in range(ORIGINAL + 4)]
        plain = SpeculativeEngine(scaled_target).generate(prompt, 30).token_ids
        result = SpeculativeEngine(scaled_target, proposer).generate(
            prompt, 30, num_speculative_tokens=4
        )
        assert result.token_ids == plain
        accepted += result.stats.num_accepted_tokens
        rejected += result.stats.num_draft_tokens - result.stats.num_accepted_tokens
    assert accepted > 10 and rejected > 10  # both engine branches ran


# (c) ---------------------------------------------------------------------------------------


def _draft_logits(drafter, target: HFTarget, kind: str) -> torch.Tensor:
    """The logits [8, V] of an 8-token chain drafted (forced along fixed tokens) after a prefix
    of 4 x ORIGINAL tokens: positions 64..71, past the longest wavelength llama3 leaves alone."""
    ids = torch.randint(0, VOCAB, (4 * ORIGINAL + 9,), generator=torch.Generator().manual_seed(3))
    prefix = ids[: 4 * ORIGINAL].tolist()
    target.reset()
    proposer = PROPOSERS[kind](drafter, target)
    proposer.start(prefix, target.forward(ids[: 4 * ORIGINAL], proposer.hidden_layers))
    forced = ids[4 * ORIGINAL + 1 :].tolist()
    proposal = proposer.propose(int(ids[4 * ORIGINAL]), 8, SamplingParams(), None, forced=forced)
    return proposal.logits


@pytest.mark.parametrize("kind", KINDS)
def test_plain_rope_drafts_other_logits_at_long_positions(kind, scaled_target):
    """The control that the scaling reaches the drafts: the same weights with the field cleared
    (plain RoPE) give other draft logits; the same config built twice gives the same ones."""
    scaled = make_drafter(kind, scaled_target, seed=2)
    plain = make_drafter(kind, scaled_target, seed=2, rope_scaling=None)
    assert _attentions(plain)[0].rope_scaling is None
    logits = _draft_logits(scaled, scaled_target, kind)
    again = _draft_logits(make_drafter(kind, scaled_target, seed=2), scaled_target, kind)
    assert torch.equal(logits, again)
    assert (_draft_logits(plain, scaled_target, kind) - logits).abs().max() > CONTROL_MARGIN


# (d) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_and_configs_without_the_field(kind, tmp_path, scaled_target):
    drafter = make_drafter(kind, scaled_target)
    path = save_drafter(drafter, tmp_path / "d")
    assert json.loads((path / "config.json").read_text())["rope_scaling"] == LLAMA3
    loaded = load_drafter(path, target=scaled_target.shape)
    assert loaded.config == drafter.config
    assert _attentions(loaded)[0].rope_scaling == LLAMA3
    assert check_drafter_dir(path, scaled_target.shape) == drafter.config
    # A config.json written before the field existed: plain RoPE, accepted on any target.
    data = drafter.config.to_dict()
    del data["rope_scaling"]
    old = type(drafter.config).from_dict(data)
    assert old.rope_scaling is None and old == drafter.config.replace(rope_scaling=None)
    old.check_target(scaled_target.shape)


def test_refusals_name_the_scalings_in_one_line(tmp_path, scaled_target):
    plain_target = HFTarget(make_hf_model("llama", vocab_size=VOCAB, seed=5))
    assert plain_target.shape.rope_scaling is None
    scaled = save_drafter(make_drafter("eagle3", scaled_target), tmp_path / "scaled")
    message = r"attention applies RoPE scaling \{'rope_type': 'llama3'.* but the target's is"
    with pytest.raises(ValueError, match=message + r" None"):
        load_drafter(scaled, target=plain_target.shape)
    with pytest.raises(DrafterCheckError, match=message) as err:
        check_drafter_dir(scaled, plain_target.shape)
    assert "\n" not in str(err.value)
    other = HFTarget(_scaled_hf(factor=4.0))
    with pytest.raises(ValueError, match=r"'factor': 8.0.* but the target's is .*'factor': 4.0"):
        PROPOSERS["eagle3"](load_drafter(scaled), other)
    # The control: the same drafter on its own target, and an unscaled one on the scaled target.
    PROPOSERS["eagle3"](load_drafter(scaled), scaled_target)
    unscaled = make_drafter("eagle", plain_target)
    assert unscaled.config.rope_scaling is None
    PROPOSERS["eagle"](unscaled, scaled_target)


def test_config_validation(scaled_target):
    c: TokenLayerConfig = make_drafter("eagle", scaled_target).config
    with pytest.raises(ValueError, match=r"EagleConfig.rope_scaling must be a dict with rope_type"):
        c.replace(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"EagleConfig.rope_scaling .* not valid for transformers"):
        # llama3 without its low / high frequency factors
        c.replace(rope_scaling={"rope_type": "llama3", "factor": 8.0, **ORIGINAL_LENGTH})
    with pytest.raises(ValueError, match=r"must not hold rope_theta"):
        c.replace(rope_scaling={**LLAMA3, "rope_theta": THETA})


# (e) ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory, scaled_model):
    base = tmp_path_factory.mktemp("scaled_export")
    scaled_model.save_pretrained(base / "target")
    assert load_target_info(base / "target").shape.rope_scaling == LLAMA3
    return base


def test_export_carries_the_scaling_into_transformers_llama(scaled_dir, scaled_target, tmp_path):
    """The exported EAGLE layer in transformers' LlamaModel built from the exported config.json
    (input and final norms made identities, as vLLM's EagleLlamaForCausalLM) computes what our
    drafter does over 4 x ORIGINAL positions; with the previous export's rope_parameters
    (default type, the base only) it does not."""
    from transformers import LlamaConfig, LlamaModel

    drafter = make_drafter("eagle", scaled_target, seed=4)
    save_drafter(drafter, scaled_dir / "eagle")
    out = export_vllm_eagle(scaled_dir / "eagle", scaled_dir / "target", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {**LLAMA3, "rope_theta": THETA}
    assert config["rope_theta"] == THETA
    weights = load_file(str(out / "model.safetensors"))
    e, seq = drafter.config.target_hidden_size, 4 * ORIGINAL
    gen = torch.Generator().manual_seed(0)
    embeds, features = torch.randn(1, seq, e, generator=gen), torch.randn(1, seq, e, generator=gen)
    with torch.no_grad():
        ours = drafter(embeds, features)
    fused = torch.cat([embeds, features], -1) @ weights["fc.weight"].T
    unscaled = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": THETA}}
    gaps = []
    for exported in (config, unscaled):
        llama = LlamaModel(LlamaConfig(**exported, attn_implementation="eager")).eval()
        llama.load_state_dict({k: v for k, v in weights.items() if k != "fc.weight"}, False)
        llama.layers[0].input_layernorm = torch.nn.Identity()
        llama.norm = torch.nn.Identity()
        with torch.no_grad():
            theirs = llama(inputs_embeds=fused).last_hidden_state
        gaps.append((theirs - ours).abs().max().item())
    # fp32, the same operations in another order: rounding-level differences only.
    assert gaps[0] < 1e-5
    assert gaps[1] > CONTROL_MARGIN, gaps


def test_eagle3_export_rotates_as_our_layer(scaled_dir, scaled_target, tmp_path):
    """EAGLE-3's layer reads 2E and has no transformers twin: the exported config's rotary, as
    transformers builds it from config.json, equals our layer's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    drafter = make_drafter("eagle3", scaled_target)
    save_drafter(drafter, scaled_dir / "eagle3")
    out = export_vllm_eagle(scaled_dir / "eagle3", scaled_dir / "target", tmp_path / "vllm")
    config = LlamaConfig(**json.loads((out / "config.json").read_text()))
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), POSITIONS[None])
    ours = _attentions(drafter)[0].cos_sin(POSITIONS, torch.float32)
    torch.testing.assert_close(ours[0], cos[0], atol=ROTARY_ATOL, rtol=0)
    torch.testing.assert_close(ours[1], sin[0], atol=ROTARY_ATOL, rtol=0)
