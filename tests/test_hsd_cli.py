"""`vllm-moa generate --hierarchy` and `vllm-moa hsd-plan` (from a file and measured), with the
mistakes a user can make in LEVELS as one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.test_cli import _error, run_cli
from vllm_moa.checkpoint import save_drafter
from vllm_moa.cli.main import main
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.presets import make_eagle_config
from vllm_moa.hf_target import load_target_info
from vllm_moa.hsd.plan import Candidate, PassCost, PlanInputs

PROMPT = "def f(x):\n    return x + f(x)\n\ndef g(x):\n    return x"


@pytest.fixture(scope="module")
def drafters(tiny_target_dir, tmp_path_factory):
    """A MoA (TLI=1) and an EAGLE drafter directory for the tiny target."""
    root = tmp_path_factory.mktemp("hsd_drafters")
    moa = root / "moa"
    assert main([
        "init-drafter", "--target", tiny_target_dir, "--out", str(moa), "--tli", "1",
        "--preset", "small", "--seed", "1",
    ]) == 0  # fmt: skip
    eagle = EagleDrafter(make_eagle_config(load_target_info(tiny_target_dir), "small"))
    eagle.init_weights(2)
    save_drafter(eagle, root / "eagle")
    return {"moa": str(moa), "eagle": str(root / "eagle")}


def _generate(capsys, target, *extra):
    base = ["generate", "--target", target, "--prompt", PROMPT, "--max-new-tokens", "16"]
    code, out, err = run_cli(capsys, *base, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_generate_with_a_hierarchy(capsys, tiny_target_dir, drafters):
    plain = _generate(capsys, tiny_target_dir)
    two = _generate(capsys, tiny_target_dir, "--hierarchy", f"ngram,{drafters['moa']}")
    assert two["token_ids"] == plain["token_ids"] and two["buffers"] == [4, 4]
    assert [level["name"] for level in two["levels"]] == ["ngram", drafters["moa"]]
    for key in ("forward_passes", "proposed", "accepted", "alpha", "acceptance_rate"):
        assert key in two["levels"][0]
    assert two["levels"][1]["accepted"] == two["num_accepted_tokens"]
    three = _generate(
        capsys, tiny_target_dir, "--hierarchy",
        f"ngram,{drafters['eagle']},{drafters['moa']}", "--buffers", "3,2,2",
    )  # fmt: skip
    assert three["token_ids"] == plain["token_ids"] and three["buffers"] == [3, 2, 2]
    sampled = _generate(
        capsys, tiny_target_dir, "--hierarchy", drafters["moa"], "--temperature", "0.8",
        "--seed", "1",
    )  # fmt: skip
    assert len(sampled["token_ids"]) == 16
    code, _, err = run_cli(
        capsys, "generate", "--target", tiny_target_dir, "--prompt", PROMPT,
        "--max-new-tokens", "8", "--hierarchy", "ngram",
    )  # fmt: skip
    assert code == 0 and "[level ngram (T=4):" in err


def test_level_mistakes_are_one_line_errors(capsys, tmp_path, tiny_target_dir, drafters):
    gen = ["generate", "--target", tiny_target_dir, "--prompt", "a", "--max-new-tokens", "4"]
    moa = drafters["moa"]
    msg = _error(capsys, *gen, "--hierarchy", f"ngram,{tiny_target_dir}")
    assert "is the target itself" in msg and "list only the drafters below the target" in msg
    copy = tmp_path / "copy_of_target"
    shutil.copytree(tiny_target_dir, copy)
    assert "is a language model (model_type 'llama')" in _error(
        capsys, *gen, "--hierarchy", str(copy)
    )
    msg = _error(capsys, *gen, "--hierarchy", "ngram,nothing_here")
    assert "'nothing_here' is neither `ngram` nor an existing drafter directory" in msg
    msg = _error(capsys, *gen, "--hierarchy", f"{moa},ngram")
    assert "level 1 (ngram) cannot verify the level below it" in msg
    other = tmp_path / "other"
    shutil.copytree(moa, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 1
    (other / "config.json").write_text(json.dumps(cfg))
    msg = _error(capsys, *gen, "--hierarchy", f"ngram,{other}")
    assert f"LEVELS entry '{other}': drafter {other}: drafter was built for a target with " in msg
    assert "vocab size 513, but the target has 512" in msg
    assert "empty entry" in _error(capsys, *gen, "--hierarchy", "ngram,,x")
    msg = _error(capsys, *gen, "--hierarchy", f"ngram,{moa}", "--buffers", "4")
    assert "--buffers has 1 sizes for 2 levels" in msg
    assert "must be integers >= 1" in _error(capsys, *gen, "--hierarchy", "ngram", "--buffers", "x")
    assert "every buffer size must be >= 1" in _error(
        capsys, *gen, "--hierarchy", "ngram", "--buffers", "0"
    )
    assert "--buffers needs --hierarchy" in _error(capsys, *gen, "--buffers", "4")
    assert "not both" in _error(capsys, *gen, "--hierarchy", "ngram", "--drafter", moa)
    assert "--hierarchy runs chains" in _error(
        capsys, *gen, "--hierarchy", moa, "--tree-depth", "3"
    )


def test_hsd_plan_from_a_file(capsys, tmp_path):
    inputs = PlanInputs(
        (Candidate("ngram", 0.0, None), Candidate("moa_dir", 0.15, PassCost(0.2))),
        PassCost(1.0),
        {"ngram": {"moa_dir": 0.6, "target": 0.3}, "moa_dir": {"target": 0.8}},
        {"target": "TGT"},
    )
    path = tmp_path / "inputs.json"
    inputs.save(path)
    code, out, _ = run_cli(capsys, "hsd-plan", "--from", str(path))
    assert code == 0
    assert "best: ngram -> moa_dir -> target" in out
    assert "run it: vllm-moa generate --target TGT --hierarchy ngram,moa_dir --buffers 8,5" in out
    code, out, _ = run_cli(capsys, "hsd-plan", "--from", str(path), "--json", "--max-buffer", "3")
    record = json.loads(out)
    assert record["plan"]["levels"] == ["ngram", "moa_dir"] and max(record["plan"]["buffers"]) <= 3
    assert [p["levels"] for p in record["plans"]][-1] == []  # plain decoding, slowest here
    assert "does not exist" in _error(capsys, "hsd-plan", "--from", str(tmp_path / "none"))
    assert "go with --measure" in _error(capsys, "hsd-plan", "--from", str(path), "--target", "x")
    assert "--measure needs --target DIR and --candidates" in _error(
        capsys, "hsd-plan", "--measure"
    )


def test_hsd_plan_measures(capsys, tmp_path, tiny_target_dir, drafters):
    out_file = tmp_path / "measured.json"
    code, out, err = run_cli(
        capsys, "hsd-plan", "--measure", "--target", tiny_target_dir,
        "--candidates", f"ngram,{drafters['moa']}", "--num-prompts", "2",
        "--max-new-tokens", "12", "--out", str(out_file),
    )  # fmt: skip
    assert code == 0, err
    assert "best: " in out and "ms/token" in out
    inputs = PlanInputs.load(out_file)
    names = [c.name for c in inputs.candidates]
    assert names == ["ngram", drafters["moa"]]
    assert inputs.candidates[0].score is None and inputs.candidates[1].score is not None
    assert set(inputs.acceptance["ngram"]) == {drafters["moa"], "target"}
    assert set(inputs.acceptance[drafters["moa"]]) == {"target"}
    assert inputs.candidates[1].draft_rate == 1.0 and inputs.target.base_s > 0
    assert inputs.candidates[1].commit.seconds(4) > 0  # MoA's memory rows
    assert inputs.notes["target"] == tiny_target_dir and inputs.notes["prompts"] == 2
    code, again, _ = run_cli(capsys, "hsd-plan", "--from", str(out_file))
    assert code == 0 and again.splitlines()[0] == out.splitlines()[0]
