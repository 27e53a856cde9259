"""MoA's draft vocabulary (docs/training.md, "MoA's draft vocabulary"): the config field and its
JSON round trip, the `draft_ids` buffer in the checkpoint (kept, checked, old drafters loading
unchanged), lossless chains and trees that draft only vocabulary tokens and are, token for
token, the argmax of the full-vocabulary logits masked to the vocabulary (with controls that
must fail), and `train --method moa --draft-vocab N`, from a new drafter and from a trained one."""

from __future__ import annotations

import copy
import json
import os
import sysconfig

import pytest
import torch
from conftest import OracleMoAProposer, make_drafter
from safetensors.torch import load_file, save_file

from vllm_moa.checkpoint import load_drafter, save_drafter
from vllm_moa.checkpoint.io import DrafterCheckError
from vllm_moa.checkpoint.validate import check_drafter_dir
from vllm_moa.decoding import SamplingParams, SpeculativeEngine
from vllm_moa.decoding.tree import DraftTree, TreeParams
from vllm_moa.drafters.draft_vocab import frequent_tokens
from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.hf_target import HFTarget
from vllm_moa.hf_target.vocab_head import VocabHead

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

PROMPTS = [[3, 17, 99, 42, 7, 250, 8, 61, 5], [1, 2, 3, 4], [200, 9, 9, 31]]
DRAFT_VOCAB = 64  # of the llama_target's 256 tokens
NEW = 24  # tokens generated per prompt


def _vocab(target: HFTarget) -> torch.Tensor:
    """The 64 tokens the target's greedy continuations of PROMPTS use most (then the smallest
    ids): the target's next tokens mostly lie inside, a random drafter's drafts often not."""
    seqs = [SpeculativeEngine(target).generate(p, NEW).token_ids for p in PROMPTS]
    return frequent_tokens(seqs, target.shape.vocab_size, DRAFT_VOCAB).token_ids


def _reduced(target: HFTarget, tli: int = 0) -> MoADrafter:
    drafter = make_drafter(target, tli=tli)
    drafter.set_draft_vocab_size(DRAFT_VOCAB)
    drafter.set_draft_vocab(_vocab(target))
    return drafter


def _whole(drafter: MoADrafter) -> MoADrafter:
    """The same drafter over the whole vocabulary."""
    whole = copy.deepcopy(drafter)
    whole.set_draft_vocab_size(None)
    return whole


# -- config and checkpoint ----------------------------------------------------------------------


def test_config_field_round_trip_and_checks(llama_target):
    """Unset, the field is not written (config.json as before it existed) and an old config
    loads with it None; set, it round-trips. Bad values are refused by name."""
    config = make_drafter(llama_target).config
    assert config.draft_vocab_size is None and not config.reduced_vocab
    data = config.to_dict()
    assert "draft_vocab_size" not in data
    assert MoAConfig.from_dict(data) == config
    reduced = config.replace(draft_vocab_size=DRAFT_VOCAB)
    assert reduced.reduced_vocab and reduced.to_dict()["draft_vocab_size"] == DRAFT_VOCAB
    assert MoAConfig.from_dict(reduced.to_dict()) == reduced
    whole = config.replace(draft_vocab_size=256)  # the whole vocabulary, written as given
    assert not whole.reduced_vocab and MoADrafter(whole).draft_ids is None
    for bad in (0, 257):
        with pytest.raises(
            ValueError, match=rf"draft_vocab_size must lie in 1\.\.256 .*, got {bad};"
        ):
            config.replace(draft_vocab_size=bad)
    with pytest.raises(TypeError, match="draft_vocab_size must be an int or null, got True"):
        config.replace(draft_vocab_size=True)


def test_checkpoint_keeps_the_ids(tmp_path, llama_target):
    """A reduced drafter saved and loaded (in another dtype) keeps its ids, int64, and passes the
    header check; a whole-vocabulary drafter stores no ids and no config key."""
    drafter = _reduced(llama_target)
    path = save_drafter(drafter, tmp_path / "reduced")
    assert json.loads((path / "config.json").read_text())["draft_vocab_size"] == DRAFT_VOCAB
    assert load_file(str(path / "model.safetensors"))["draft_ids"].dtype == torch.int64
    check_drafter_dir(path, llama_target.shape)
    loaded = load_drafter(path, target=llama_target.shape, dtype=torch.bfloat16)
    assert isinstance(loaded, MoADrafter) and loaded.draft_ids is not None
    assert loaded.draft_ids.dtype == torch.int64
    assert torch.equal(loaded.draft_ids, drafter.draft_ids)
    whole = save_drafter(make_drafter(llama_target), tmp_path / "whole")
    assert "draft_vocab_size" not in json.loads((whole / "config.json").read_text())
    assert "draft_ids" not in load_file(str(whole / "model.safetensors"))
    assert load_drafter(whole).draft_ids is None


def test_malformed_ids_are_refused(tmp_path, llama_target):
    """Ids out of order or out of the vocabulary are refused on load; ids of another count, of
    a float or int32 dtype, or missing, are refused by the header check and on load."""
    path = save_drafter(_reduced(llama_target), tmp_path / "drafter")
    file = path / "model.safetensors"
    state = load_file(str(file))
    ids = state["draft_ids"]
    unordered = r"draft_ids: .*strictly ascending in 0\.\.255"
    on_load = [(ids.flip(0), unordered), (ids + 256 - int(ids.max()), unordered)]
    for bad, message in on_load:
        save_file({**state, "draft_ids": bad}, str(file))
        check_drafter_dir(path)  # the header is right: names, shapes, dtypes
        with pytest.raises(ValueError, match=message):
            load_drafter(path)
    in_header = [({**state, "draft_ids": ids[1:]}, rf"draft_ids has shape \({DRAFT_VOCAB - 1},\)"),
                 ({**state, "draft_ids": ids.float()}, r"draft_ids \(F32, expected I64\)"),
                 ({**state, "draft_ids": ids.int()}, r"draft_ids \(I32, expected I64\)"),
                 ({k: v for k, v in state.items() if k != "draft_ids"},
                  r"missing \['draft_ids'\]")]  # fmt: skip
    for bad_state, message in in_header:
        save_file(bad_state, str(file))
        with pytest.raises(DrafterCheckError, match=message):
            check_drafter_dir(path)
        with pytest.raises(DrafterCheckError, match=message):
            load_drafter(path)


def test_set_draft_vocab_refusals(llama_target):
    drafter = make_drafter(llama_target)
    with pytest.raises(ValueError, match="no draft vocabulary to set"):
        drafter.set_draft_vocab(torch.arange(DRAFT_VOCAB))
    drafter.set_draft_vocab_size(DRAFT_VOCAB)
    assert drafter.draft_ids is not None and drafter.draft_ids.tolist() == list(range(64))
    with pytest.raises(ValueError, match=r"draft_vocab_size = 64 token ids, got shape \(63,\)"):
        drafter.set_draft_vocab(torch.arange(DRAFT_VOCAB - 1))
    with pytest.raises(ValueError, match="strictly ascending"):
        drafter.set_draft_vocab(torch.arange(DRAFT_VOCAB).flip(0))
    with pytest.raises(ValueError, match=r"must lie in 1\.\.256"):
        drafter.set_draft_vocab_size(300)


# -- drafting -----------------------------------------------------------------------------------


def test_whole_vocabulary_drafts_through_the_target_head(llama_target):
    """Without a draft vocabulary the proposer calls the target's own lm_logits: the code path
    (and so the numbers) of drafters made before the feature."""
    proposer = MoAProposer(make_drafter(llama_target), llama_target)
    assert proposer.lm_logits == llama_target.lm_logits


def test_vocab_head_is_the_head_at_its_rows(llama_target):
    """VocabHead's logits are the target head's at the draft ids (float rounding: a GEMM of 64
    rows against one of 256) and -inf at every other token."""
    ids = _vocab(llama_target)
    head = llama_target.vocab_head(ids)
    hidden = torch.randn(
        5, llama_target.shape.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        got, full = head(hidden), llama_target.lm_logits(hidden)
    outside = torch.ones(llama_target.shape.vocab_size, dtype=torch.bool)
    outside[ids] = False
    torch.testing.assert_close(got[:, ids], full[:, ids], atol=1e-5, rtol=1e-5)
    assert torch.isneginf(got[:, outside]).all()
    assert torch.equal(got.argmax(-1), ids[full[:, ids].argmax(-1)])


@pytest.mark.parametrize("tli", [0, 1])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_chains_are_lossless_and_stay_in_the_vocabulary(llama_target, tli, k):
    """With drafts mostly right (the oracle's bonus on the target's next token, when it is a
    draft token), generation equals plain decoding, drafts are accepted, and every draft is a
    draft token."""
    drafter = _reduced(llama_target, tli)
    vocab = set(drafter.draft_ids.tolist())  # type: ignore[union-attr]
    accepted = 0
    for prompt in PROMPTS:
        plain = SpeculativeEngine(llama_target).generate(prompt, NEW).token_ids
        proposer = OracleMoAProposer(drafter, llama_target, corrupt_every=4)
        drafted: list[int] = []
        original = proposer.propose

        def recording(*args, original=original, drafted=drafted):  # type: ignore[no-untyped-def]
            proposal = original(*args)
            drafted.extend(proposal.tokens)
            return proposal

        proposer.propose = recording  # type: ignore[method-assign]
        result = SpeculativeEngine(llama_target, proposer).generate(
            prompt, NEW, num_speculative_tokens=k
        )
        assert result.token_ids == plain
        assert drafted and set(drafted) <= vocab
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


class MaskedProposer(MoAProposer):
    """The reference: a whole-vocabulary proposer whose logits are the target head's full
    logits with every token outside `ids` set to -inf (no gathered rows involved)."""

    def __init__(self, drafter: MoADrafter, target: HFTarget, ids: torch.Tensor) -> None:
        super().__init__(drafter, target)
        outside = torch.ones(target.shape.vocab_size, dtype=torch.bool)
        outside[ids] = False
        self.lm_logits = lambda h: target.lm_logits(h).masked_fill(outside, float("-inf"))


class ShiftedRowsProposer(MoAProposer):
    """Control: the draft vocabulary's logits from the wrong rows (token i+1's at token i)."""

    def __init__(self, drafter: MoADrafter, target: HFTarget, ids: torch.Tensor) -> None:
        super().__init__(drafter, target)
        self.lm_logits = VocabHead(target.lm_head.weight.roll(-1, 0), None, ids)


def _chains(proposer: MoAProposer, target: HFTarget, k: int = 4) -> list[tuple]:
    """(context, drafted chain, logits) of every cycle of greedy generations of PROMPTS."""
    cycles: list[tuple] = []
    original = proposer.propose

    def recording(last, n, params, gen, *rest):  # type: ignore[no-untyped-def]
        proposal = original(last, n, params, gen, *rest)
        cycles.append(((*proposer.tokens, last), proposal.tokens, proposal.logits))
        return proposal

    proposer.propose = recording  # type: ignore[method-assign]
    for prompt in PROMPTS:
        SpeculativeEngine(target, proposer).generate(prompt, NEW, num_speculative_tokens=k)
    return cycles


@pytest.mark.parametrize("tli", [0, 1])
def test_chains_are_the_masked_full_vocabulary_argmax(llama_target, tli):
    """Every chain of the reduced drafter is, token for token, the chain of the same drafter
    drafting from the target's full logits masked to the vocabulary, and the logits agree
    (-inf at the same tokens). Controls: the unrestricted drafter drafts tokens outside the
    vocabulary (so the restriction changed the chains), and logits from shifted rows draft
    other chains."""
    drafter = _reduced(llama_target, tli)
    ids = drafter.draft_ids
    assert ids is not None
    got = _chains(MoAProposer(drafter, llama_target), llama_target)
    reference = _chains(MaskedProposer(_whole(drafter), llama_target, ids), llama_target)
    assert [(c, t) for c, t, _ in got] == [(c, t) for c, t, _ in reference]
    for (_, _, mine), (_, _, theirs) in zip(got, reference, strict=True):
        assert torch.equal(torch.isneginf(mine), torch.isneginf(theirs))
        torch.testing.assert_close(mine[:, ids], theirs[:, ids], atol=1e-5, rtol=1e-5)
    assert sum(len(t) for _, t, _ in got) > 20
    vocab = set(ids.tolist())
    free = _chains(MoAProposer(_whole(drafter), llama_target), llama_target)
    assert any(set(t) - vocab for _, t, _ in free), "the unrestricted chains stay in the vocabulary"
    shifted = _chains(ShiftedRowsProposer(_whole(drafter), llama_target, ids), llama_target)
    assert [t for _, t, _ in shifted] != [t for _, t, _ in got]


def _tree(
    proposer: MoAProposer, target: HFTarget, prompt: list[int], tree: TreeParams
) -> DraftTree:
    target.reset()
    proposer.start(prompt[:-1], target.forward(torch.tensor(prompt[:-1]), proposer.hidden_layers))
    return proposer.propose_tree(prompt[-1], tree.depth, tree.breadth, tree.budget)


@pytest.mark.parametrize("tli", [0, 1])
def test_trees_are_the_masked_reference_trees_and_lossless(llama_target, tli):
    """EAGLE-2 trees (breadth below the vocabulary's size): the reduced drafter's tree from a
    prompt is the masked reference's (tokens, parents, path log-probabilities), every node a
    draft token; generation with trees equals plain decoding. Control: the unrestricted
    drafter's tree holds tokens outside the vocabulary."""
    drafter = _reduced(llama_target, tli)
    ids = drafter.draft_ids
    assert ids is not None
    vocab, tree = set(ids.tolist()), TreeParams(4, 4, 12)
    outside = 0
    for prompt in PROMPTS:
        mine = _tree(MoAProposer(drafter, llama_target), llama_target, prompt, tree)
        ref = _tree(MaskedProposer(_whole(drafter), llama_target, ids), llama_target, prompt, tree)
        assert (mine.tokens, mine.parents) == (ref.tokens, ref.parents)
        assert mine.log_probs == pytest.approx(ref.log_probs, abs=1e-4)
        assert set(mine.tokens) <= vocab
        free = _tree(MoAProposer(_whole(drafter), llama_target), llama_target, prompt, tree)
        outside += len(set(free.tokens) - vocab)
        plain = SpeculativeEngine(llama_target).generate(prompt, NEW).token_ids
        proposer = OracleMoAProposer(drafter, llama_target, corrupt_every=4)
        assert (
            SpeculativeEngine(llama_target, proposer).generate(prompt, NEW, tree=tree).token_ids
            == plain
        )
    assert outside > 0


def test_sampled_drafts_stay_in_the_vocabulary(llama_target):
    """At temperature 1 the drafts are sampled from the drafter's distribution: probability 0
    outside the vocabulary."""
    drafter = _reduced(llama_target)
    vocab = set(drafter.draft_ids.tolist())  # type: ignore[union-attr]
    proposer = MoAProposer(drafter, llama_target)
    llama_target.reset()
    prompt = PROMPTS[0]
    proposer.start(prompt[:-1], llama_target.forward(torch.tensor(prompt[:-1])))
    gen = torch.Generator().manual_seed(0)
    proposal = proposer.propose(prompt[-1], 6, SamplingParams(temperature=1.0), gen)
    assert set(proposal.tokens) <= vocab
    assert proposal.probs is not None
    outside = torch.ones(llama_target.shape.vocab_size, dtype=torch.bool)
    outside[list(vocab)] = False
    assert (proposal.probs[:, outside] == 0).all()


# -- training -----------------------------------------------------------------------------------


def _train(out, target_dir, *extra: str) -> int:
    from vllm_moa.cli.main import main

    data = os.path.join(sysconfig.get_paths()["stdlib"], "csv.py")
    args = ["train", "--target", target_dir, "--data", data, "--out", str(out),
            "--max-steps", "2", "--batch-size", "2", "--max-length", "48", "--eval-examples",
            "4", "--device", "cpu", *extra]  # fmt: skip
    return main(args)


def _expected_vocab(target_dir: str, n: int) -> torch.Tensor:
    """The n most frequent trained tokens of the training examples `_train` reads."""
    from transformers import AutoTokenizer

    from vllm_moa.factories.methods import trained_tokens
    from vllm_moa.training.data import load_examples

    data = os.path.join(sysconfig.get_paths()["stdlib"], "csv.py")
    examples = load_examples([data], AutoTokenizer.from_pretrained(target_dir), 48)
    train = examples[: len(examples) - min(4, len(examples) // 5)]
    return frequent_tokens(trained_tokens(train), 512, n).token_ids


def test_train_draft_vocab_new_and_continued(tmp_path, tiny_target_dir, capsys):
    """`train --method moa --draft-vocab 64`: the drafter holds the 64 most frequent trained
    tokens, recorded in its config and the run's; `--drafter D --draft-vocab 32` gives a trained
    drafter a new vocabulary (EAGLE-3's, its own head's size, is refused there)."""
    from vllm_moa.drafters.eagle3.model import Eagle3Drafter
    from vllm_moa.drafters.presets import make_eagle3_config
    from vllm_moa.hf_target import load_target_info

    assert _train(tmp_path / "new", tiny_target_dir, "--method", "moa", "--draft-vocab", "64") == 0
    drafter_dir = tmp_path / "new" / "drafter"
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["draft_vocab_size"] == 64 and config["training"]["draft_vocab"] == 64
    assert json.loads((tmp_path / "new" / "train_config.json").read_text())["draft_vocab"] == 64
    assert "draft vocabulary: the 64 most frequent" in capsys.readouterr().out
    drafter = load_drafter(drafter_dir)
    assert isinstance(drafter, MoADrafter) and drafter.draft_ids is not None
    assert torch.equal(drafter.draft_ids, _expected_vocab(tiny_target_dir, 64))
    check_drafter_dir(drafter_dir)

    args = ("--drafter", str(drafter_dir), "--draft-vocab", "32")
    assert _train(tmp_path / "again", tiny_target_dir, *args) == 0
    again = load_drafter(tmp_path / "again" / "drafter")
    assert isinstance(again, MoADrafter) and again.draft_ids is not None
    assert torch.equal(again.draft_ids, _expected_vocab(tiny_target_dir, 32))
    assert (
        json.loads((tmp_path / "again" / "drafter" / "config.json").read_text())["draft_vocab_size"]
        == 32
    )

    eagle3 = Eagle3Drafter(make_eagle3_config(load_target_info(tiny_target_dir), "small"))
    save_drafter(eagle3, tmp_path / "eagle3")
    capsys.readouterr()
    args = ("--drafter", str(tmp_path / "eagle3"), "--draft-vocab", "32")
    assert _train(tmp_path / "refused", tiny_target_dir, *args) == 1
    assert "--draft-vocab sets up a new drafter" in capsys.readouterr().err
