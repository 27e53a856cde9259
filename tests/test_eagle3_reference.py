"""Our EAGLE-3 drafter (`vllm_moa/drafters/eagle3/`) against the logits of the EAGLE-3 authors'
own code.

tests/data/eagle3/ holds a tiny random Llama target (8 layers, so that the feature layers 2, 4, 5
are distinct), one random drafter in their release layout (`midlayer.*`, `fc`, `norm`,
`lm_head`, `d2t`, `t2d`; their config.json) and what their code computes with it
(scripts/make_eagle3_fixtures.py: commit cb7e084, transformers 4.53.1, how to rerun): their
inference drafter prefilled with P = 6 verified tokens then a chain of D = 7 drafts forced along
the data; their own `topK_genrate` with top_k 1 (the greedy chain); their training-time test, 7
steps over T = 16 tokens, each step's logits and loss. The release loads into our
`Eagle3Drafter` by renaming `midlayer.` to `layer.` (d2t / t2d are the identity maps of a
whole-vocabulary draft and are dropped); `export-eagle` writes it back as their tensors. The
renaming here is written by hand, apart from `vllm-moa convert-official`'s
(checkpoint/official_eagle3.py), which tests/test_convert_eagle3.py checks against it.

Positions. Their training step j (0-based) at position t reads the feature of target position t
(fc's at step 0, step j-1's output at t after), the token x[t+1+j] and RoPE position t + j, and
is trained on the target's logits at t + 1 + j. That is our pass j's layer input t + j, so the
row of its `DraftForward` (rows are indexed by the position whose next token they predict) is
t + 1 + j; the test checks that, and that rows t + j do not match. With P verified tokens, their
inference draft step j (the prefix pass, then j forced tokens) is training step j at t = P - 1,
and our proposer's j-th draft after `start(ids[:P])`, `propose(ids[P], ...)`.

Tolerance: both sides compute in float32 on the same bfloat16-valued weights and differ only in
operation order (our fused SDPA when drafting against their matmul-softmax, RoPE tables built
per position against their cached table, how the GQA heads are repeated, the target's own
attention). float32 rounds at 6e-8 relative; about a dozen dependent stages (the 8-layer
target, fc over 192 inputs, one decoder layer per draft step up to seven steps deep, the norm
and the LM head), each a sum of at most 192 products, keep the error near 1e-6 on logits of at
most 3.9: observed 1.1e-6 on the inference drafts, 9.5e-7 on the greedy chain, 2.0e-6 on the
training steps, 9.5e-7 on the losses and 3.3e-6 on the target states (of magnitude up to 8.5);
their own inference and training code differ by 2.2e-6 on these fixtures. ATOL 1e-4 leaves a
30x margin, and each control below moves some logit by 0.35 to 3.5, at least 3500x ATOL (the
rows one position off: 4.1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_moa.checkpoint.io import save_drafter
from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle
from vllm_moa.decoding.proposer import DraftProposal
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.drafters.eagle3.config import Eagle3Config, default_feature_layers
from vllm_moa.drafters.eagle3.method import Eagle3Method
from vllm_moa.drafters.eagle3.model import Eagle3Block, Eagle3Drafter
from vllm_moa.drafters.eagle3.proposer import Eagle3Proposer
from vllm_moa.drafters.token_layers import TokenLayerConfig
from vllm_moa.hf_target import HFTarget
from vllm_moa.model.config import DrafterConfig
from vllm_moa.model.layers import DecoderBlock
from vllm_moa.model.masks import aligned_pass_mask
from vllm_moa.training.data import Batch, Example, collate
from vllm_moa.training.losses import masked_kl
from vllm_moa.training.methods import AlignedPass

DATA = Path(__file__).parent / "data" / "eagle3"
ATOL = 1e-4
CONTROL_MARGIN = 100 * ATOL  # a control must move some logit by at least this


def _golden() -> tuple[dict[str, torch.Tensor], dict]:
    manifest = json.loads((DATA / "manifest.json").read_text())
    return load_file(str(DATA / "golden.safetensors")), manifest


def _target() -> HFTarget:
    return HFTarget.from_pretrained(DATA / "target", dtype=torch.float32)


def release_weights() -> dict[str, torch.Tensor]:
    """Their release's tensors under our names: `midlayer.*` is our `layer.*`; `fc`, `norm`
    and `lm_head` are named alike. `d2t` / `t2d` must be the identity maps (the draft
    vocabulary is the whole vocabulary) and are dropped, as their EaModel drops them."""
    tensors = load_file(str(DATA / "release" / "model.safetensors"))
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
    assert not d2t.any() and bool(t2d.all())
    return {
        ("layer." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name): t
        for name, t in tensors.items()
    }


def release_config(target: HFTarget) -> Eagle3Config:
    """Our config from their config.json and the target's shape. Their config has no
    `rope_theta` (their code then uses 10000) and no layer ids (theirs are 2, L//2, L-3)."""
    release = json.loads((DATA / "release" / "config.json").read_text())
    return Eagle3Config(
        **DrafterConfig.target_fields(target.shape),
        num_heads=release["num_attention_heads"],
        num_kv_heads=release["num_key_value_heads"],
        intermediate_size=release["intermediate_size"],
        rope_theta=release.get("rope_theta", 10000.0),
        rms_norm_eps=release["rms_norm_eps"],
        feature_layers=default_feature_layers(target.shape.num_layers),
        draft_vocab_size=release["draft_vocab_size"],
    )


def _drafter(target: HFTarget, cls: type[Eagle3Drafter] = Eagle3Drafter) -> Eagle3Drafter:
    drafter = cls(release_config(target))
    drafter.load_state_dict(release_weights(), strict=True)
    return drafter.float().eval()


def _drafted(
    drafter: Eagle3Drafter,
    target: HFTarget,
    forced: bool = True,
    proposer_cls: type[Eagle3Proposer] = Eagle3Proposer,
) -> DraftProposal:
    """The standalone proposer's chain of D drafts after the P verified tokens and token P,
    forced along the data (or greedy)."""
    golden, manifest = _golden()
    ids, p, d = golden["input_ids"].tolist(), manifest["verified"], manifest["draft_steps"]
    proposer = proposer_cls(drafter, target)
    proposer.start(ids[:p], target.forward(torch.tensor(ids[:p]), proposer.hidden_layers))
    path = ids[p + 1 : p + 1 + d] if forced else ()
    return proposer.propose(ids[p], d, SamplingParams(), None, forced=path)


def _aligned(
    drafter: Eagle3Drafter, target: HFTarget
) -> tuple[list[AlignedPass], Batch, torch.Tensor]:
    """Our training-time test: `Eagle3Method.aligned`, 7 passes, no top-k mask (EAGLE-3's);
    with the batch and the target's logits [1, T, V]."""
    golden, manifest = _golden()
    ids = golden["input_ids"].tolist()
    method = Eagle3Method(drafter, target)
    batch = collate([Example(ids, [True] * len(ids), manifest["verified"])])
    with torch.no_grad():
        target_out = target.forward_batch(batch.input_ids, method.hidden_layers)
        limits = torch.arange(len(ids))[None]  # ignored by EAGLE's aligned passes
        passes = method.aligned(batch, target_out, limits, None, None, manifest["train_steps"], 0)
    return passes, batch, target_out.logits


def _training_error(passes: list[AlignedPass], shift: int = 1) -> float:
    """Max |ours - theirs| of their step j at t against our pass j's row t + shift + j."""
    golden, _ = _golden()
    theirs = golden["training_logits"]  # [S, T, V]
    seq = theirs.shape[1]
    assert len(passes) == theirs.shape[0]
    worst = 0.0
    for j, p in enumerate(passes):
        n = seq - shift - j  # their positions t = 0..n-1 (t + 1 + j <= T-1 when shift = 1)
        ours = p.forward.logits[0, shift + j : shift + j + n]
        worst = max(worst, (ours - theirs[j, :n]).abs().max().item())
    return worst


def test_release_loads_into_our_drafter():
    """Every release tensor has a place in our drafter and the shapes agree (strict load); the
    feature layers are theirs."""
    target = _target()
    drafter = _drafter(target)
    _, manifest = _golden()
    assert drafter.feature_layers() == tuple(manifest["feature_layers"]) == (2, 4, 5)
    assert drafter.config.intermediate_size == manifest["drafter_intermediate_size"]
    assert drafter.config.rope_theta == manifest["target"]["rope_theta"] == 10000.0


def test_our_export_writes_their_release(tmp_path):
    """`vllm-moa export-eagle` of the drafter loaded from their release writes their tensors
    back, under their names and bit for bit (less d2t / t2d, which vLLM refuses when the
    vocabularies agree), and their config's sizes."""
    target = _target()
    drafter = Eagle3Drafter(release_config(target)).to(torch.bfloat16)
    drafter.load_state_dict(release_weights(), strict=True)
    out = export_vllm_eagle(save_drafter(drafter, tmp_path / "d"), DATA / "target", tmp_path / "x")
    exported = load_file(str(out / "model.safetensors"))
    release = load_file(str(DATA / "release" / "model.safetensors"))
    assert sorted(exported) == sorted(set(release) - {"d2t", "t2d"})
    assert all(torch.equal(exported[name], release[name]) for name in exported)
    assert all(exported[name].dtype == release[name].dtype for name in exported)  # bfloat16
    config = json.loads((out / "config.json").read_text())
    theirs = json.loads((DATA / "release" / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        assert config[key] == theirs[key], key
    assert config["draft_vocab_size"] == theirs["draft_vocab_size"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_target_states_are_their_aux_states():
    """Our target's inputs of layers 2, 4, 5, concatenated ascending, are the three states their
    target model returns (what fc reads on both sides)."""
    golden, _ = _golden()
    target = _target()
    layers = release_config(target).feature_layers
    out = target.forward_batch(golden["input_ids"][None], layers)
    ours = torch.cat([out.hidden_states[layer][0] for layer in layers], dim=-1)
    torch.testing.assert_close(ours, golden["aux_states"], atol=ATOL, rtol=0)


def test_proposer_drafts_their_inference_logits():
    """Our standalone proposer prefilled with the P verified tokens, then a chain forced along
    the data: every draft's logits are their inference drafter's."""
    golden, _ = _golden()
    target = _target()
    proposal = _drafted(_drafter(target), target)
    torch.testing.assert_close(proposal.logits, golden["inference_logits"], atol=ATOL, rtol=0)


def test_proposer_greedy_chain_is_their_topk_genrate():
    """Unforced and greedy, our proposer drafts their `topK_genrate`'s top_k-1 chain, with its
    logits."""
    golden, _ = _golden()
    target = _target()
    proposal = _drafted(_drafter(target), target, forced=False)
    assert proposal.tokens == golden["greedy_tokens"].tolist()
    torch.testing.assert_close(proposal.logits, golden["greedy_logits"], atol=ATOL, rtol=0)


def test_aligned_passes_are_their_training_steps():
    """Our pass j's row t + 1 + j is their training step j at position t, for every step and
    every position where it drafts a real token; one row earlier (t + j) is not."""
    target = _target()
    passes, _, _ = _aligned(_drafter(target), target)
    assert _training_error(passes) <= ATOL
    assert _training_error(passes, shift=0) > CONTROL_MARGIN


def test_aligned_losses_are_their_step_losses():
    """Their step loss is the soft cross-entropy to the target's logits at t + 1 + j over the
    positions where loss_mask[t + j], averaged over all T. Our passes train the same rows
    (each pass's mask as `aligned_loss` applies it), and on them our KL plus the target's
    entropy, scaled by rows / T, is their loss: ours is their objective up to a constant and
    the normalisation (docs/eagle3.md)."""
    golden, _ = _golden()
    target = _target()
    passes, batch, target_logits = _aligned(_drafter(target), target)
    loss_mask, seq = golden["loss_mask"].bool(), target_logits.shape[1]
    for j, p in enumerate(passes):
        assert p.forward.valid is not None
        mask = batch.loss_mask & p.forward.valid & p.mask  # what aligned_loss trains
        rows = mask[0].nonzero().flatten().tolist()
        assert rows == [t + 1 + j for t in range(seq - 1 - j) if loss_mask[t + j]]
        kl = masked_kl(target_logits, p.forward.logits, mask)
        log_p = target_logits[mask].log_softmax(-1)
        entropy = -(log_p.exp() * log_p).sum(-1).mean()
        theirs = golden["training_losses"][j]
        torch.testing.assert_close((kl + entropy) * len(rows) / seq, theirs, atol=ATOL, rtol=0)


# -- Controls: each must move the logits far outside the tolerance -----------------------------


class _ReversedFeatures(Eagle3Drafter):
    """The three target states concatenated high to low."""

    def target_features(self, hidden_states):
        dtype = self.fc.weight.dtype
        states = [hidden_states[layer].to(dtype) for layer in reversed(self.feature_layers())]
        return self.fc(torch.cat(states, dim=-1))


class _NormedResidualBlock(Eagle3Block):
    """vLLM's `norm_before_residual: true` (the speculators format's default): the residual is
    hidden_norm(h) instead of h."""

    def forward(self, x, positions, k, v, mask):
        h = self.hidden_norm(x[..., self.width :])
        h = h + self.self_attn(self._attention_input(x), positions, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _NormedResidual(Eagle3Drafter):
    @staticmethod
    def make_layer(config: TokenLayerConfig) -> DecoderBlock:
        return _NormedResidualBlock(config)


class _UnshiftedProposer(Eagle3Proposer):
    """Every draft step at the chain's first drafted position (their `len_posi += 1` dropped)."""

    def _step(self, first, next_ids, features):
        return super()._step(min(first, len(self.tokens)), next_ids, features)


class _UnshiftedBlock(Eagle3Block):
    """Training: pass j's queries and keys at its cycle's first position t, not t + j (their
    `position_ids + lck` without lck). EagleDrafter.forward calls kv_from once per pass."""

    def __init__(self, config: TokenLayerConfig) -> None:
        super().__init__(config)
        self.passes = 0

    def kv_from(self, source, positions):
        self.passes += 1
        return super().kv_from(source, positions - (self.passes - 1))

    def forward(self, x, positions, k, v, mask):
        return super().forward(x, positions - (self.passes - 1), k, v, mask)


class _UnshiftedTraining(Eagle3Drafter):
    @staticmethod
    def make_layer(config: TokenLayerConfig) -> DecoderBlock:
        return _UnshiftedBlock(config)


def _mask_before_09b1628(
    pass_index: int, seq_len: int, device: torch.device | None = None
) -> torch.Tensor:
    """Their training mask until commit 09b1628 (2025-09-16): after each step j' they also hid
    the step-0 key at t - j' from the query at t, so step j saw step-0 keys at t - j and
    before only: our pass j's block 0 at u <= i - 2j."""
    mask = aligned_pass_mask(pass_index, seq_len, device)
    i = torch.arange(seq_len, device=device)[:, None]
    u = torch.arange(seq_len, device=device)[None, :]
    mask[:, :seq_len] &= u <= i - 2 * pass_index
    return mask


INFERENCE_CONTROLS = {
    "reversed_features": (_ReversedFeatures, Eagle3Proposer),
    "normed_residual": (_NormedResidual, Eagle3Proposer),
    "unshifted_rope": (Eagle3Drafter, _UnshiftedProposer),
}


@pytest.mark.parametrize("control", sorted(INFERENCE_CONTROLS))
def test_inference_controls_fail(control):
    golden, _ = _golden()
    target = _target()
    drafter_cls, proposer_cls = INFERENCE_CONTROLS[control]
    bad = _drafted(_drafter(target, drafter_cls), target, proposer_cls=proposer_cls).logits
    assert (bad - golden["inference_logits"]).abs().max() > CONTROL_MARGIN


TRAINING_CONTROLS = {
    "reversed_features": _ReversedFeatures,
    "normed_residual": _NormedResidual,
    "unshifted_rope": _UnshiftedTraining,
}


@pytest.mark.parametrize("control", sorted(TRAINING_CONTROLS))
def test_training_controls_fail(control):
    target = _target()
    passes, _, _ = _aligned(_drafter(target, TRAINING_CONTROLS[control]), target)
    assert _training_error(passes) > CONTROL_MARGIN


def test_training_with_their_old_mask_fails(monkeypatch):
    """Control: the mask their training used before commit 09b1628 misses their current
    logits (so the fixtures tell the two apart)."""
    monkeypatch.setattr("vllm_moa.drafters.eagle.model.aligned_pass_mask", _mask_before_09b1628)
    target = _target()
    passes, _, _ = _aligned(_drafter(target), target)
    assert _training_error(passes) > CONTROL_MARGIN
