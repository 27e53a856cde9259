"""The testbed's `ci` preset runs the whole chain: target, eight drafters (the five, the two
slim-LSA MoA and GRIFFIN), evaluation, report; token-aligned drafters beside them; then the
memory ablation on it."""

import gzip
import json
from pathlib import Path

import pytest

PROMPTS = Path(__file__).resolve().parent / "data" / "humaneval_prompts.jsonl"


@pytest.mark.slow
def test_testbed_ci_preset(tmp_path):
    from benchmarks.testbed.__main__ import main
    from benchmarks.testbed.drafters import EXTRA_METHODS, METHODS, SLIM_METHODS

    prompts = PROMPTS
    results = tmp_path / "results.json"
    assert (
        main(
            [
                "--preset",
                "ci",
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "w"),
                "--results",
                str(results),
                "--tree",
                "3",
                "2",
                "4",
                "--methods",
                *METHODS,
                *SLIM_METHODS,
                *EXTRA_METHODS,
            ]
        )
        == 0
    )
    report = json.loads(results.read_text())
    assert report["git_sha"] and report["machine"]["cpu_count"] and report["complete"]
    import torch

    assert report["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    methods = {*METHODS, *SLIM_METHODS, *EXTRA_METHODS}
    assert set(report["results"]) == methods | {"plain"}
    assert report["results"]["plain"]["target_heldout_loss"] > 0.0
    # equal trainable parameter counts, but for EAGLE-3 (its own LM head: drafters.py)
    params = [report["drafter_training"][m]["parameters"] for m in methods - {"eagle3"}]
    assert max(params) / min(params) < 1.02
    assert report["drafter_training"]["eagle3"]["parameters"] > 0
    for m in methods:
        for k in ("k4", "k6"):
            r = report["results"][m][k]
            assert r["lossless"] and 1.0 <= r["tau"] <= int(k[1:]) + 1
    for m in methods:  # every drafter drafts trees
        assert report["results"][m]["tree_d3_b2_m4"]["lossless"]
    assert results.with_suffix(".png").is_file()

    # A cached stage made with other settings is refused, not silently reused.
    for flag, stage in (("--target-steps", "target_steps"), ("--drafter-steps", "drafter_steps")):
        again = ["--preset", "ci", "--prompts", str(prompts), "--out", str(tmp_path / "w")]
        with pytest.raises(SystemExit, match=rf"{stage}=\d+ \(now 99\).*another --out"):
            main([*again, flag, "99", "--methods", "eagle"])

    # MoA with another training K range is its own, cached drafter beside the default one.
    other = tmp_path / "k2_3.json"
    refresh = ["--moa-refresh", "2", "3", "--methods", "moa_tli0", "eagle"]
    second = ["--skip-prompts", "1", "--eval-prompts", "1"]  # another held-out slice
    assert main([*again, *refresh, *second, "--results", str(other)]) == 0
    report = json.loads(other.read_text())
    assert report["skipped_prompts"] == 1 and report["config"]["eval_prompts"] == 1
    assert set(report["results"]) == {"moa_tli0_k2_3", "eagle", "plain"}
    assert report["config"]["moa_refresh"] == [2, 3]
    assert report["results"]["moa_tli0_k2_3"]["k4"]["lossless"]
    assert (tmp_path / "w" / "drafters" / "moa_tli0_k2_3" / "done.json").is_file()
    with pytest.raises(SystemExit):  # argparse: MIN > MAX
        main([*again, "--moa-refresh", "3", "2"])

    # Token-aligned drafters are their own, cached drafters beside the unaligned ones.
    aligned = tmp_path / "aligned.json"
    align = ["--methods", "griffin", "moa_tli0", "--align-steps", "2", "--align-topk", "4"]
    assert main([*again, *align, *second, "--results", str(aligned)]) == 0
    report = json.loads(aligned.read_text())
    assert set(report["results"]) == {"griffin_a2t4", "moa_tli0_a2t4", "plain"}
    assert report["config"]["align_steps"] == 2 and report["config"]["align_topk"] == 4
    run = tmp_path / "w" / "drafters" / "griffin_a2t4"
    assert json.loads((run / "train_config.json").read_text())["align_steps"] == 2
    assert report["results"]["griffin_a2t4"]["k4"]["lossless"]

    # GRIFFIN's staged schedule (--align-stages): stage 1 plain, stage 2 with 2 passes from stage
    # 1's drafter and continuing its data, at the run's total steps (the ci preset's 8).
    staged = tmp_path / "staged.json"
    stages = ["--methods", "moa_tli0", "--align-steps", "2", "--align-stages"]
    assert main([*again, *stages, *second, "--results", str(staged)]) == 0
    report = json.loads(staged.read_text())
    assert set(report["results"]) == {"moa_tli0_a2st", "plain"}
    run = tmp_path / "w" / "drafters" / "moa_tli0_a2st"
    first, last = (json.loads((d / "train_config.json").read_text()) for d in (run / "stage1", run))
    assert (first["max_steps"], first["align_steps"], first["skip_steps"]) == (4, 1, 0)
    assert (last["max_steps"], last["align_steps"], last["skip_steps"]) == (4, 2, 4)
    assert last["drafter"] == str(run / "stage1" / "drafter")
    assert report["results"]["moa_tli0_a2st"]["k4"]["lossless"]

    # Drafters of another seed (same target) are cached and reported beside the seed-0 ones;
    # --drafter-seed 0 is the default and reuses them.
    seeds = tmp_path / "seeds.json"
    seeded = ["--methods", "eagle", "--eval-prompts", "1", "--results", str(seeds)]
    assert main([*again, *seeded, "--drafter-seed", "1"]) == 0
    assert set(json.loads(seeds.read_text())["results"]) == {"eagle_s1", "plain"}
    assert main([*again, *seeded, "--drafter-seed", "0"]) == 0
    assert set(json.loads(seeds.read_text())["results"]) == {"eagle", "plain"}
    first = tmp_path / "w" / "drafters"
    assert (first / "eagle_s1" / "done.json").is_file()
    assert (
        json.loads((first / "eagle_s1" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
        != json.loads((first / "eagle" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    )
    with pytest.raises(SystemExit):  # argparse: steps must be positive
        main([*again, "--target-steps", "0"])
    with pytest.raises(SystemExit, match=r"no prompts in .* after the first 100000"):
        main([*again, "--methods", "eagle", "--skip-prompts", "100000"])

    # The memory ablation (benchmarks/memory_ablation.py) runs on the same testbed.
    from benchmarks.memory_ablation import main as ablation

    out = tmp_path / "ablation.json"
    work = str(tmp_path / "w")
    assert (
        ablation(
            ["--testbed", work, "--preset", "ci", "--prompts", str(prompts), "--out", str(out)]
        )
        == 0
    )
    figures = json.loads(out.read_text())["figures"]
    # ci target: 3 layers, E = 2 * E_kv = 128, so every variant applies
    assert set(figures) == {
        "lsa (moa_tli0)", "hidden_final", "hidden_2", "hidden_1",
        "lsa_last_layer", "lsa_last_row", "lsa_on_hidden_2", "hidden_2_small", "lsa_slim",
    }  # fmt: skip
    for f in figures.values():
        assert all(0.0 <= a <= 1.0 for a in f["teacher_forced_agreement_per_stale_step"])
    assert out.with_suffix(".png").is_file()


def test_git_sha_marks_uncommitted_code(tmp_path):
    """Results name the commit that made them: "+dirty" when tracked code differs from HEAD
    (not for figures written under benchmarks/results), "unknown" outside a repository."""
    import subprocess

    from benchmarks.testbed.report import git_sha

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    assert git_sha(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    sha = git_sha(tmp_path)
    assert len(sha) == 40
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"tau": 2}\n')
    (tmp_path / "new.py").write_text("untracked\n")
    assert git_sha(tmp_path) == sha
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_sha(tmp_path) == f"{sha}+dirty"


def test_run_names():
    """Another K range (MoA only) or drafter seed gives a drafter its own cache and report name."""
    from benchmarks.testbed.drafters import run_name
    from benchmarks.testbed.presets import PRESETS

    cfg = PRESETS["ci"]
    assert run_name("moa_tli1", cfg) == "moa_tli1" and run_name("eagle", cfg) == "eagle"
    other = cfg.replace(moa_refresh=(3, 8), drafter_seed=2)
    assert run_name("moa_tli1_slim", other) == "moa_tli1_slim_k3_8_s2"
    assert run_name("eagle", other) == "eagle_s2"
    aligned = cfg.replace(align_steps=3)
    assert run_name("griffin", aligned) == "griffin_a3"
    assert run_name("moa_tli1", aligned.replace(align_topk=5, drafter_seed=1)) == "moa_tli1_a3t5_s1"
    assert other.seed_of_drafters == 2 and cfg.seed_of_drafters == cfg.seed
    recipe = other.replace(sa_staircase="release", ca_memory="release", norm_init="normal")
    name = "moa_tli0_slim_k3_8_stairrelease_carelease_normnormal_s2"
    assert run_name("moa_tli0_slim", recipe) == name
    assert run_name("eagle", recipe) == "eagle_s2"  # the recipe's options are MoA's
    staged = cfg.replace(align_steps=3, align_stages=True)
    assert run_name("moa_tli0", staged) == "moa_tli0_a3st"
    head = cfg.replace(head_init="target")
    assert run_name("eagle3", head) == "eagle3_headtarget" and run_name("eagle", head) == "eagle"


def test_align_stages_split_the_steps():
    """GRIFFIN's staged schedule at the run's total steps: stage n of N with n passes."""
    from benchmarks.testbed.drafters import align_stages
    from benchmarks.testbed.presets import PRESETS

    cfg = PRESETS["cpu"].replace(align_steps=3, align_stages=True, drafter_steps=451)
    stages = align_stages(cfg)
    assert [(s.drafter_steps, s.align_steps) for s in stages] == [(150, None), (150, 2), (151, 3)]
    assert not any(s.align_stages for s in stages)
    assert align_stages(cfg.replace(align_stages=False)) == [cfg.replace(align_stages=False)]
    for bad in (cfg.replace(align_steps=None), cfg.replace(drafter_steps=2)):
        with pytest.raises(ValueError, match="--align-steps >= 2"):
            align_stages(bad)


def test_recipe_options_reach_moa_training_only(tmp_path):
    from benchmarks.testbed.drafters import drafter_train_config
    from benchmarks.testbed.presets import PRESETS

    cfg = PRESETS["ci"].replace(sa_staircase="release", ca_memory="release")
    moa = drafter_train_config(cfg, tmp_path, [tmp_path], tmp_path, tmp_path, method="moa_tli0")
    assert (moa.sa_staircase, moa.ca_memory) == ("release", "release")
    eagle = drafter_train_config(cfg, tmp_path, [tmp_path], tmp_path, tmp_path, method="eagle3")
    assert (eagle.sa_staircase, eagle.ca_memory) == ("off", "inference")


def _run(names, seed_taus, **shared):
    figures = {"plain": {"k4": {"tokens_per_second": 1.0}}}
    for name, tau in zip(names, seed_taus, strict=True):
        figures[name] = {"k4": {"tau": tau}, "k6": {"tau": tau + 0.5}}
    config = {"num_layers": 4, "ks": [4, 6], "drafter_seed": None}
    return {"preset": "cpu", "prompts": "p", "config": config, "results": figures,
            "command": "c", "git_sha": "x", "complete": True, **shared}  # fmt: skip


def test_merge_gives_each_recipe_its_spread_over_seeds(tmp_path):
    from benchmarks.testbed.merge import merge

    runs = [
        _run(["moa_k3_8"], [3.0]),
        _run(["moa_k3_8_s1"], [3.2]),
        _run(["moa_k3_8_normnormal", "eagle"], [2.8, 2.5]),
        _run(["moa_k3_8_normnormal_s1"], [3.0]),
    ]
    report = merge(runs)
    assert set(report["results"]) == {
        "plain", "moa_k3_8", "moa_k3_8_s1", "moa_k3_8_normnormal", "moa_k3_8_normnormal_s1", "eagle"
    }  # fmt: skip
    base = report["spread"]["moa_k3_8"]
    assert base["runs"] == ["moa_k3_8", "moa_k3_8_s1"]
    assert base["k4"]["mean"] == pytest.approx(3.1) and base["k6"]["max"] == pytest.approx(3.7)
    assert report["spread"]["moa_k3_8_normnormal"]["k4"]["min"] == pytest.approx(2.8)
    with pytest.raises(ValueError, match="in two runs"):
        merge([runs[0], runs[0]])
    with pytest.raises(ValueError, match="'preset'"):
        merge([runs[0], {**runs[1], "preset": "cpu-deep"}])


def test_read_prompts_takes_a_slice(tmp_path):
    from benchmarks.testbed.evaluate import read_prompts

    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(5):
            f.write(json.dumps({"prompt": f"p{i}"}) + "\n\n")
    assert read_prompts(path, 2) == ["p0", "p1"]
    assert read_prompts(path, 2, skip=2) == ["p2", "p3"]
    assert read_prompts(path, 9, skip=4) == ["p4"]
    assert read_prompts(path, 2, skip=5) == []
