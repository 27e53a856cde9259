"""EAGLE-3's reduced draft vocabulary (docs/eagle3.md, "The reduced draft vocabulary"): how it is
picked from the data, the d2t / t2d maps, logits over the whole vocabulary (-inf outside it),
lossless chains and trees whose drafts are the restricted argmax of a full-vocabulary twin, the
restricted loss against a hand computation, `train --draft-vocab`, the checkpoint's dtype checks
and the vLLM export."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file, save_file

from vllm_moa.checkpoint import load_drafter, save_drafter
from vllm_moa.checkpoint.io import DrafterCheckError
from vllm_moa.checkpoint.validate import check_drafter_dir
from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.decoding.tree import TreeParams
from vllm_moa.drafters.draft_vocab import frequent_tokens
from vllm_moa.drafters.eagle3.method import Eagle3Method
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.drafters.presets import TargetInfo, make_eagle3_config
from vllm_moa.factories.proposers import make_proposer
from vllm_moa.hf_target import HFTarget
from vllm_moa.training.alignment import aligned_loss
from vllm_moa.training.data import Example, collate
from vllm_moa.training.losses import masked_kl, vocab_positions
from vllm_moa.training.methods import AlignedPass, DraftForward

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

VOCAB = 24
DRAFT_VOCAB = 10  # of 24: the target's continuations use more tokens, so some fall outside
PROMPTS = [[1, 5, 3], [7] * 9, list(range(12)) * 2]

# -- picking the vocabulary ---------------------------------------------------------------------


def test_frequent_tokens_by_hand():
    """Counts 5: 3, 3: 2, and 2, 7, 9: 1 each: the top 3 are 5, 3 and (a tie) the smallest of
    2, 7, 9; sorted by id. With more slots than distinct tokens, unseen ids fill, smallest first."""
    tokens = [[5, 5, 3, 9], [3, 5, 7, 2]]
    vocab = frequent_tokens(tokens, 10, 3)
    assert vocab.token_ids.tolist() == [2, 3, 5]
    assert vocab.coverage == pytest.approx(6 / 8) and vocab.distinct == 5
    assert frequent_tokens(tokens, 10, 7).token_ids.tolist() == [0, 1, 2, 3, 5, 7, 9]
    with pytest.raises(ValueError, match=r"--draft-vocab must lie in 1\.\.10"):
        frequent_tokens(tokens, 10, 11)
    with pytest.raises(ValueError, match=r"outside 0\.\.9"):
        frequent_tokens([[10]], 10, 3)


# -- the drafter --------------------------------------------------------------------------------


@functools.cache
def _target() -> HFTarget:
    return HFTarget(make_hf_model(vocab_size=VOCAB, num_layers=4, seed=11))


def _config(draft_vocab: int | None = DRAFT_VOCAB):
    target = _target()
    return make_eagle3_config(
        TargetInfo(target.shape, target.config.num_attention_heads), "small", draft_vocab
    )


def _continuations() -> list[list[int]]:
    """The target's greedy continuations of random prompts: what the drafter learns."""
    target, gen = _target(), torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(8):
        prompt = torch.randint(0, VOCAB, (4,), generator=gen).tolist()
        seqs.append(prompt + SpeculativeEngine(target).generate(prompt, 28).token_ids)
    return seqs


@functools.cache
def _trained() -> tuple[Eagle3Drafter, list[int]]:
    """A reduced-vocabulary drafter (its vocabulary the data's most frequent tokens) distilled
    for a few steps with the restricted loss, and its draft tokens' ids."""
    target, seqs = _target(), _continuations()
    drafter = Eagle3Drafter(_config())
    drafter.init_weights(0)
    vocab = frequent_tokens([s[1:] for s in seqs], VOCAB, DRAFT_VOCAB)
    drafter.set_draft_vocab(vocab.token_ids)
    method = Eagle3Method(drafter, target)
    batch = collate([Example(s, [True] * len(s), 4) for s in seqs])
    with torch.no_grad():
        target_out = target.forward_batch(batch.input_ids, method.hidden_layers)
    limits = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(60):
        out = method.forward(batch, target_out, limits, None)
        assert out.vocab is drafter.t2d
        mask = batch.loss_mask & out.valid & vocab_positions(target_out.logits, out.vocab)
        masked_kl(target_out.logits, out.logits, mask, out.vocab).backward()
        opt.step()
        opt.zero_grad()
    return drafter.eval(), vocab.token_ids.tolist()


def test_maps_and_logits():
    """d2t is the offset to the target id, t2d marks the draft tokens; the logits are the head's
    at those ids and -inf elsewhere, so the argmax is the head's argmax mapped through d2t."""
    drafter = Eagle3Drafter(_config())
    drafter.init_weights(1)
    ids = torch.tensor([0, 2, 3, 7, 8, 11, 15, 16, 20, 23])
    drafter.set_draft_vocab(ids)
    assert drafter.d2t is not None and drafter.t2d is not None
    assert drafter.d2t.tolist() == [0, 1, 1, 4, 4, 6, 9, 9, 12, 14]
    assert drafter.t2d.nonzero().flatten().tolist() == ids.tolist()
    states = torch.randn(2, 3, drafter.config.target_hidden_size)
    with torch.no_grad():
        logits = drafter.logits(states, lambda s: s)
        head = drafter.lm_head(drafter.norm(states))
    assert logits.shape == (2, 3, VOCAB)
    assert torch.equal(logits[..., ids], head)
    assert torch.isneginf(logits[..., ~drafter.t2d]).all()
    assert torch.equal(logits.argmax(-1), ids[head.argmax(-1)])
    assert (logits.softmax(-1)[..., ~drafter.t2d] == 0).all()
    full = Eagle3Drafter(_config(None))
    assert full.d2t is None and "d2t" not in full.state_dict()
    with pytest.raises(ValueError, match="strictly ascending"):
        drafter.set_draft_vocab(ids.flip(0))
    with pytest.raises(ValueError, match=r"draft_vocab_size = 10 token ids, got shape \(9,\)"):
        drafter.set_draft_vocab(ids[1:])
    with pytest.raises(ValueError, match="no draft vocabulary to set"):
        full.set_draft_vocab(ids)


def test_loaded_maps_are_checked():
    """A d2t / t2d pair that disagree, or a d2t that does not ascend, is refused on load."""
    drafter = Eagle3Drafter(_config())
    state = drafter.state_dict()
    t2d = state["t2d"].clone()
    t2d[0] = False
    with pytest.raises(ValueError, match="t2d marks 9 target tokens"):
        Eagle3Drafter(_config()).load_state_dict({**state, "t2d": t2d})
    d2t = state["d2t"].clone()
    d2t[1] = -1  # draft id 1 -> target id 0, as draft id 0
    with pytest.raises(ValueError, match=r"d2t: .*strictly ascending"):
        Eagle3Drafter(_config()).load_state_dict({**state, "d2t": d2t})


# -- drafting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_chains_are_lossless(k):
    target, (drafter, _) = _target(), _trained()
    accepted = 0
    for prompt in PROMPTS:
        plain = SpeculativeEngine(target).generate(prompt, 30).token_ids
        proposer = make_proposer(drafter, target)
        result = SpeculativeEngine(target, proposer).generate(prompt, 30, num_speculative_tokens=k)
        assert result.token_ids == plain
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("tree", [TreeParams(3, 2, 5), TreeParams(6, 8, 40)])
def test_trees_are_lossless(tree):
    target, (drafter, _) = _target(), _trained()
    accepted = 0
    for prompt in PROMPTS:
        plain = SpeculativeEngine(target).generate(prompt, 30).token_ids
        proposer = make_proposer(drafter, target)
        result = SpeculativeEngine(target, proposer).generate(prompt, 30, tree=tree)
        assert result.token_ids == plain
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def _twin(drafter: Eagle3Drafter, ids: list[int]) -> Eagle3Drafter:
    """A whole-vocabulary drafter with the same weights, its head's row of target id ids[i] the
    reduced head's row i (the other rows random): its logits restricted to `ids` are the
    reduced drafter's draft logits, computed without d2t."""
    twin = Eagle3Drafter(_config(None))
    twin.init_weights(7)
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}
    head = twin.lm_head.weight.detach().clone()
    head[ids] = state["lm_head.weight"]
    twin.load_state_dict({**state, "lm_head.weight": head})
    return twin.eval()


def _mismatches(drafter: Eagle3Drafter, twin: Eagle3Drafter, ids: list[int]) -> int:
    """Generate with `drafter`; at every draft the training forward of `twin` reproduces (the
    accepted drafts and the first rejected one, under the cycle's memory limits), count the
    drafts that are not the argmax of the twin's logits restricted to `ids`."""
    target, method = _target(), Eagle3Method(twin, _target())
    index = torch.tensor(ids)
    checked = wrong = 0
    for prompt in PROMPTS:
        proposer = make_proposer(drafter, target)
        cycles = []
        original = proposer.propose

        def recording(last, k, params, gen, proposer=proposer, original=original, cycles=cycles):
            p = len(proposer.tokens)
            proposal = original(last, k, params, gen)
            cycles.append((p, proposal))
            return proposal

        proposer.propose = recording
        result = SpeculativeEngine(target, proposer).generate(prompt, 30, num_speculative_tokens=4)
        seq = prompt + result.token_ids
        limits = torch.arange(len(seq))
        checks = []
        for p, proposal in cycles:
            n = 0
            while n < len(proposal.tokens) and p + 1 + n < len(seq):
                if proposal.tokens[n] != seq[p + 1 + n]:
                    break
                n += 1
            for i in range(min(n + 1, len(proposal.tokens))):
                limits[p + i] = p
                checks.append((p + i, proposal.tokens[i], proposal.logits[i]))
        batch = collate([Example(seq, [True] * len(seq), len(prompt))])
        with torch.no_grad():
            target_out = target.forward_batch(batch.input_ids, method.hidden_layers)
            out = method.forward(batch, target_out, limits[None], None)
        for pos, token, row in checks:
            reference = out.logits[0, pos, index]
            wrong += token != ids[int(reference.argmax())]
            assert torch.isneginf(row[drafter.t2d.logical_not()]).all()
        checked += len(checks)
    assert checked > 10
    return wrong


def test_drafts_are_the_restricted_argmax_of_a_full_vocabulary_twin():
    """Every draft of a generation is the argmax, over the draft vocabulary, of a
    whole-vocabulary twin's logits at the same context. Control: the same drafter with d2t off
    by one drafts the neighbouring ids and is caught."""
    drafter, ids = _trained()
    twin = _twin(drafter, ids)
    assert _mismatches(drafter, twin, ids) == 0
    shifted = Eagle3Drafter(_config())
    shifted.load_state_dict(drafter.state_dict())
    assert ids[-1] + 1 < VOCAB
    shifted.set_draft_vocab(torch.tensor(ids) + 1)
    assert _mismatches(shifted.eval(), twin, ids) > 0


# -- the loss -----------------------------------------------------------------------------------


def _kl(p_logits: list[float], q_logits: list[float]) -> float:
    p = [math.exp(x) for x in p_logits]
    q = [math.exp(x) for x in q_logits]
    zp, zq = sum(p), sum(q)
    return sum(a / zp * math.log((a / zp) / (b / zq)) for a, b in zip(p, q, strict=True))


def test_restricted_loss_by_hand():
    """Target rows whose argmax lies outside the draft vocabulary {0, 2, 3} (row 0: token 1)
    are left out, the others train KL(softmax(target[{0, 2, 3}]) || softmax(draft[{0, 2, 3}])),
    in each pass, pass 2 weighted 0.8 (the authors' per-step mask: it does not chain). Controls:
    the unrestricted target distribution, and keeping row 0, give other values."""
    vocab = torch.tensor([True, False, True, True, False])
    target = torch.tensor([[[0.1, 2.0, 0.3, -0.5, 0.0], [0.2, 0.1, 1.5, 0.4, 1.0],
                            [-1.0, 0.5, 0.0, 0.9, 0.2]]])  # fmt: skip
    draft = torch.tensor([[[0.3, 0.0, -0.2, 0.6, 0.0], [1.0, 0.0, 0.2, -0.3, 0.0],
                           [0.0, 0.0, 0.7, 0.1, 0.0]]])  # fmt: skip
    draft[..., ~vocab] = float("-inf")  # as Eagle3Drafter.logits gives them
    cols = [0, 2, 3]
    rows = [_kl([target[0, r, c].item() for c in cols], [draft[0, r, c].item() for c in cols])
            for r in range(3)]  # fmt: skip
    expected = (rows[1] + rows[2]) / 2 * (1 + 0.8)
    passes = [AlignedPass(DraftForward(draft, [], vocab=vocab), torch.ones(1, 3, dtype=torch.bool))
              for _ in range(2)]  # fmt: skip
    loss = aligned_loss(passes, target, torch.ones(1, 3, dtype=torch.bool), 1.0, 0.0, 0.8)
    assert loss.loss.item() == pytest.approx(expected, rel=1e-5)
    assert loss.kept == 1.0
    assert vocab_positions(target, vocab).tolist() == [[False, True, True]]
    # Controls: keeping row 0; the target's whole-vocabulary distribution (its mass outside the
    # draft vocabulary counted; the drafter's -inf there makes that KL infinite).
    assert abs(sum(rows) / 3 * 1.8 - expected) > 1e-2
    unrestricted = masked_kl(target, draft, torch.tensor([[False, True, True]]))
    assert not math.isfinite(unrestricted.item())


# -- training, checkpoints, export ---------------------------------------------------------------


def _train(tmp_path, target_dir, *extra: str) -> int:
    import os
    import sysconfig

    from vllm_moa.cli.main import main

    data = os.path.join(sysconfig.get_paths()["stdlib"], "csv.py")
    args = ["train", "--target", target_dir, "--data", data, "--out", str(tmp_path / "run"),
            "--max-steps", "2", "--batch-size", "2", "--max-length", "48", "--eval-examples",
            "4", "--align-steps", "2", "--device", "cpu", *extra]  # fmt: skip
    return main(args)


def test_train_draft_vocab(tmp_path, tiny_target_dir, capsys):
    """`train --method eagle3 --draft-vocab 64`: the vocabulary is the 64 most frequent trained
    tokens of the training examples, recorded in the configs; the run's losses are finite; the
    drafter loads and passes the checkpoint check. Kinds without one refuse the flag."""
    import os
    import sysconfig

    from transformers import AutoTokenizer

    from vllm_moa.factories.methods import trained_tokens
    from vllm_moa.training.data import load_examples

    code = _train(tmp_path, tiny_target_dir, "--method", "eagle3", "--draft-vocab", "64")
    assert code == 0
    out = tmp_path / "run"
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["draft_vocab_size"] == 64 and config["training"]["draft_vocab"] == 64
    assert json.loads((out / "train_config.json").read_text())["draft_vocab"] == 64
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert "draft vocabulary: the 64 most frequent" in capsys.readouterr().out
    data = os.path.join(sysconfig.get_paths()["stdlib"], "csv.py")
    examples = load_examples([data], AutoTokenizer.from_pretrained(tiny_target_dir), 48)
    train = examples[: len(examples) - min(4, len(examples) // 5)]
    expected = frequent_tokens(trained_tokens(train), 512, 64).token_ids
    drafter = load_drafter(out / "drafter")
    assert isinstance(drafter, Eagle3Drafter)
    assert torch.equal(drafter.draft_token_ids(), expected)
    check_drafter_dir(out / "drafter")
    assert _train(tmp_path, tiny_target_dir, "--method", "eagle", "--draft-vocab", "64") == 1
    assert "--draft-vocab 64 applies to MoA and EAGLE-3 only" in capsys.readouterr().err


@pytest.fixture
def reduced(tmp_path):
    """A reduced-vocabulary drafter saved beside its target."""
    make_hf_model(vocab_size=VOCAB, num_layers=4, seed=11).save_pretrained(tmp_path / "target")
    drafter = Eagle3Drafter(_config())
    drafter.init_weights(3)
    drafter.set_draft_vocab(torch.tensor([1, 2, 4, 6, 9, 10, 13, 17, 19, 22]))
    return save_drafter(drafter, tmp_path / "drafter"), drafter


def test_checkpoint_dtypes(reduced):
    """d2t (int64) and t2d (bool) are stored and accepted as such; a float or int32 d2t is
    refused, as is an integer tensor where a weight belongs."""
    path, drafter = reduced
    file = path / "model.safetensors"
    state = load_file(str(file))
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    check_drafter_dir(path)
    loaded = load_drafter(path, dtype=torch.bfloat16)
    assert loaded.d2t.dtype == torch.int64 and torch.equal(loaded.d2t, drafter.d2t)
    bad = [("d2t", state["d2t"].float(), r"d2t \(F32, expected I64\)"),
           ("d2t", state["d2t"].int(), r"d2t \(I32, expected I64\)"),
           ("t2d", state["t2d"].to(torch.uint8), r"t2d \(U8, expected BOOL\)"),
           ("norm.weight", state["norm.weight"].long(), r"norm\.weight \(I64\)")]  # fmt: skip
    for name, tensor, message in bad:
        save_file({**state, name: tensor}, str(file))
        with pytest.raises(DrafterCheckError, match=message):
            check_drafter_dir(path)
        with pytest.raises(DrafterCheckError, match=message):
            load_drafter(path)


def test_export_round_trip_and_vllm_names(reduced, tmp_path):
    """export-eagle writes d2t / t2d under the authors' names and dtypes, and every other tensor
    as ours (renamed); loaded back into our drafter it is the same drafter. The names and dtypes
    are those vLLM 0.32's loader expects, mirrored from its source (not run here)."""
    path, drafter = reduced
    out = export_vllm_eagle(path, tmp_path / "target", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == VOCAB
    weights = load_file(str(out / "model.safetensors"))
    ours = drafter.state_dict()
    back = {k.replace("midlayer.", "layer."): v for k, v in weights.items()}
    assert back.keys() == ours.keys()
    for name, tensor in ours.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    again = Eagle3Drafter(dataclasses.replace(drafter.config))
    again.load_state_dict(back)
    assert torch.equal(again.draft_token_ids(), drafter.draft_token_ids())

    # vLLM 0.32, vllm/model_executor/models/llama_eagle3.py:
    # - :339-345 Eagle3LlamaForCausalLM creates `draft_id_to_target_id`, a torch.long parameter
    #   of shape [draft_vocab_size], when config.draft_vocab_size != the target's vocab size;
    # - :426-429 load_weights skips names containing "t2d" and renames "d2t" to
    #   "draft_id_to_target_id" (top level, not under "model.");
    # - :443-444 every other name but lm_head's is loaded under "model.", where
    #   :290-299 maps "midlayer." to "layers.0.";
    # - :385-391 compute_logits scatters the draft logits to `arange(draft_vocab_size) + d2t`.
    assert weights["d2t"].dtype == torch.int64 and weights["d2t"].shape == (DRAFT_VOCAB,)
    assert weights["t2d"].dtype == torch.bool and weights["t2d"].shape == (VOCAB,)
    targets = torch.arange(DRAFT_VOCAB) + weights["d2t"]
    assert torch.equal(targets, weights["t2d"].nonzero().flatten())
    assert weights["lm_head.weight"].shape == (DRAFT_VOCAB, drafter.config.target_hidden_size)
    vllm_names = {"draft_id_to_target_id" if k == "d2t" else
                  k if k.startswith("lm_head") else "model." + k.replace("midlayer.", "layers.0.")
                  for k in weights if "t2d" not in k}  # fmt: skip
    assert "draft_id_to_target_id" in vllm_names and "model.fc.weight" in vllm_names
    assert all(n.startswith(("model.fc.", "model.layers.0.", "model.norm.", "lm_head.",
                             "draft_id_to_target_id")) for n in vllm_names)  # fmt: skip
