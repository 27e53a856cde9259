"""The MoA training recipe's options (`--sa-staircase`, `--ca-memory`, `--norm-init`) and the
Cross-Attention's training mask on conversations of several turns (docs/training.md, 'The MoA
recipe'): each option does what the MoA authors' code does, and the defaults are unchanged."""

import pytest
import torch
from conftest import make_drafter

from vllm_moa.model.masks import bounded_memory_limits, release_memory_limits
from vllm_moa.training.config import TrainConfig
from vllm_moa.training.schedule import (
    memory_limits,
    response_tokens,
    staircase_probability,
    staircase_rows,
    step_generator,
)


def config(**kw):
    return TrainConfig(**{"target": "t", "data": ("d",), "out": "o", "max_steps": 100, **kw})


def reference_limits(seq_len, prompt_len, k):
    """The single-turn mask as written before turns were taken into account."""
    return [i if i < prompt_len else prompt_len + (i - prompt_len) // k * k for i in range(seq_len)]


@pytest.mark.parametrize(("seq_len", "prompt_len", "k"), [(12, 3, 4), (20, 0, 5), (9, 9, 2)])
def test_single_turn_limits_are_unchanged(seq_len, prompt_len, k):
    expected = reference_limits(seq_len, prompt_len, k)
    assert bounded_memory_limits(seq_len, prompt_len, k).tolist() == expected
    every = torch.ones(seq_len, dtype=torch.bool)  # a text example: every token trained
    assert bounded_memory_limits(seq_len, prompt_len, k, every).tolist() == expected


def test_a_later_turn_starts_its_own_cycles_after_the_prefilled_user_turn():
    """Inference prefills a conversation's user turn, so the first draft of the next assistant
    turn sees every row before it (limit = its position) and cycles restart there."""
    # user 0..2, assistant 3..6, user 7..8, assistant 9..13
    response = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    limits = bounded_memory_limits(14, 3, 4, response).tolist()
    assert limits == [0, 1, 2, 3, 3, 3, 3, 7, 8, 9, 9, 9, 9, 13]
    # Control: the grid of the first turn runs on (the mask before this change): the second
    # turn's first drafts would not see the user turn just before them.
    old = bounded_memory_limits(14, 3, 4).tolist()
    assert old[9:12] == [7, 7, 11] and old[9] < 9


def test_memory_limits_read_the_turns_from_the_batch_loss_mask():
    # Position t is trained to predict token t + 1: the loss mask is the response shifted.
    response = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    loss_mask = torch.cat([response[:, 1:], torch.zeros(1, 1, dtype=torch.bool)], dim=1)
    assert response_tokens(loss_mask)[0, 1:].tolist() == response[0, 1:].tolist()
    cfg = config(refresh_min=3, refresh_max=3)
    limits = memory_limits(torch.tensor([2]), 10, cfg, step_generator(0, 1, 0), loss_mask)
    assert limits[0].tolist() == bounded_memory_limits(10, 2, 3, response[0]).tolist()
    assert limits[0, 7] == 7  # the second turn's first draft sees the user turn


def test_release_mask_is_the_authors_one():
    """Their moa_spec.py: refresh points every `every` positions from the sequence start and at
    every prompt token; a query sees rows up to its last refresh point, its own row included
    there (which no draft sees at inference)."""
    response = torch.tensor([0] * 10 + [1] * 10, dtype=torch.bool)
    limits = release_memory_limits(20, 6, response).tolist()
    assert limits[10:12] == [10, 10]  # the first response tokens: rows 0..9, as at inference
    assert limits[12] == 13  # 12 % 6 == 0: rows 0..12, its own among them
    assert limits[13:18] == [13] * 5
    assert limits[18] == 19
    assert limits[:10] == list(range(1, 11))  # prompt tokens: their own row too
    cfg = config(ca_memory="release", refresh_min=6, refresh_max=6)
    loss_mask = torch.cat([response[1:], torch.zeros(1, dtype=torch.bool)])[None]
    got = memory_limits(torch.tensor([10]), 20, cfg, step_generator(0, 1, 0), loss_mask)
    assert got[0].tolist() == limits


def test_staircase_schedules():
    half, release = config(sa_staircase="half"), config(sa_staircase="release")
    assert [staircase_probability(s, half) for s in (1, 50, 51, 100)] == [1.0, 1.0, 0.0, 0.0]
    assert staircase_probability(1, release) == 1.0
    assert staircase_probability(26, release) == pytest.approx(0.5)
    assert staircase_probability(51, release) == 0.0
    assert all(staircase_probability(s, config()) == 0.0 for s in (1, 60))
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert staircase_rows(0.0, 4, gen) is None
    assert staircase_rows(1.0, 4, gen).tolist() == [True] * 4
    assert torch.equal(gen.get_state(), state)  # no draw: other runs reproduce
    drawn = torch.stack([staircase_rows(0.3, 4, gen) for _ in range(500)]).float().mean()
    assert 0.25 < drawn < 0.35


def test_staircase_half_trains_as_before(llama_target):
    """`half` (the old `--sa-staircase`) passes the limits as SA's window to every sequence."""
    from vllm_moa.drafters.moa.method import MoAMethod
    from vllm_moa.training.data import Example, collate
    from vllm_moa.training.trainer import compute_loss

    drafter = make_drafter(llama_target)
    method = MoAMethod(drafter, llama_target)
    seq = [3, 17, 99, 42, 7, 250, 8, 61, 5, 11, 12, 13, 14, 15]
    batch = collate([Example(seq, [False] * 4 + [True] * 10, 4)] * 2)
    target_out = llama_target.forward_batch(batch.input_ids, method.hidden_layers)
    cfg = config(refresh_min=3, refresh_max=5)
    seen = []
    forward = method.forward

    def spy(batch, target_out, limits, sa_from, gen=None):
        seen.append((limits, sa_from))
        return forward(batch, target_out, limits, sa_from, gen)

    method.forward = spy
    with torch.no_grad():
        compute_loss(method, llama_target, batch, target_out, cfg, step_generator(0, 1, 0), 1.0)
        compute_loss(method, llama_target, batch, target_out, cfg, step_generator(0, 1, 0), 0.0)
    (limits, sa_from), (limits_off, sa_off) = seen
    assert torch.equal(sa_from, limits) and torch.equal(limits, limits_off) and sa_off is None


def test_norm_init_normal_changes_the_norms_only(llama_target):
    ones = make_drafter(llama_target, seed=3)
    normal = make_drafter(llama_target, seed=3)
    normal.init_weights(3, norm_init="normal")
    norms = 0
    for (name, a), (_, b) in zip(ones.named_parameters(), normal.named_parameters(), strict=True):
        if name.endswith("layernorm.weight"):
            norms += 1
            assert torch.all(a == 1) and b.std().item() == pytest.approx(0.02, rel=0.5)
            assert abs(b.mean().item()) < 0.01
        else:
            assert torch.equal(a, b), name
    assert norms == 6  # SA, CA and LSA: input and post-attention norms
    with pytest.raises(ValueError, match="norm_init"):
        ones.init_weights(0, norm_init="zeros")


def test_recipe_options_are_checked():
    assert config(sa_staircase=True).sa_staircase == "half"  # train_config.json of old runs
    assert config(sa_staircase=False).sa_staircase == "off"
    with pytest.raises(ValueError, match="sa_staircase must be one of"):
        config(sa_staircase="all")
    with pytest.raises(ValueError, match="ca_memory must be one of"):
        config(ca_memory="own")
    with pytest.raises(ValueError, match="TLI 0 without token alignment"):
        config(ca_memory="release", tli=1)
    with pytest.raises(ValueError, match="TLI 0 without token alignment"):
        config(ca_memory="release", align_steps=3)


def test_train_cli_takes_the_recipe_options(tiny_target_dir, tmp_path):
    """`vllm-moa train --sa-staircase release --ca-memory release --norm-init normal` trains
    and records them; a new drafter's norms are drawn from N(0, 0.02)."""
    import json

    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.cli.main import main

    data = tmp_path / "code.py"
    data.write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "run"
    flags = ["--sa-staircase", "release", "--ca-memory", "release", "--norm-init", "normal"]
    main(
        ["train", "--target", tiny_target_dir, "--data", str(data), "--out", str(out),
         "--max-steps", "2", "--batch-size", "2", "--max-length", "32", "--eval-examples", "0",
         "--device", "cpu", *flags]
    )  # fmt: skip
    recorded = json.loads((out / "train_config.json").read_text())
    assert (recorded["sa_staircase"], recorded["ca_memory"], recorded["norm_init"]) == (
        "release",
        "release",
        "normal",
    )
    assert (out / "drafter" / "config.json").is_file()
    drafter = load_drafter(out / "drafter")
    assert drafter.self_attention.input_layernorm.weight.abs().mean() < 0.2  # not ones


def test_eagle3_head_from_the_target(tiny_target_dir):
    """`--head-init target`: a new EAGLE-3 drafter's final norm and LM head are copies of the
    target's (the authors' code starts them from random, as the default does)."""
    from vllm_moa.factories.methods import build_method
    from vllm_moa.hf_target import HFTarget

    target = HFTarget.from_pretrained(tiny_target_dir)
    made = {
        init: build_method(
            TrainConfig(
                target=tiny_target_dir,
                data=("d",),
                out="o",
                max_steps=1,
                method="eagle3",
                head_init=init,
            ),
            target,
        ).model
        for init in ("random", "target")
    }
    copied, random = made["target"], made["random"]
    assert torch.equal(copied.lm_head.weight, target.lm_head.weight)
    assert torch.equal(copied.norm.weight, target.norm.weight)
    assert not torch.equal(random.lm_head.weight, target.lm_head.weight)  # control
    assert torch.equal(copied.fc.weight, random.fc.weight)  # the rest as initialised
    moa = TrainConfig(target=tiny_target_dir, data=("d",), out="o", max_steps=1, head_init="target")
    with pytest.raises(ValueError, match="LM head of their own"):
        build_method(moa, target)
    with pytest.raises(ValueError, match="--head-init sets up a new drafter"):
        build_method(
            TrainConfig(
                target=tiny_target_dir,
                data=("d",),
                out="o",
                max_steps=1,
                method="eagle3",
                head_init="target",
                drafter="somewhere",
            ),
            target,
        )
