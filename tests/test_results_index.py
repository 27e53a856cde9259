"""The results index, its README and the docs' generated tables are up to date with
benchmarks/results/; every results file lies in its benchmark's folder under a unique name and
records no machine path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import results_paths
from benchmarks.results_index import index_rows, main, problems, render_index, render_table
from benchmarks.results_paths import RESULTS, find, machine_paths, portable


def test_index_and_generated_tables_are_fresh():
    assert main(["--check"]) == 0, "run `python -m benchmarks.results_index`"


def test_index_has_a_row_per_results_file_with_key_figures():
    rows = [line for line in render_index().splitlines() if line]
    sweep = next(r for r in rows if '"file": "serve_sweep/serve_sweep_cpu_inflated.json"' in r)
    assert '"moa_tli0@inf"' in sweep and '"git_sha"' in sweep and '"date": "2026-' in sweep


def test_readme_lists_every_results_file_by_folder_with_date_sha_and_command():
    readme = (RESULTS / "README.md").read_text()
    rows = index_rows()
    assert len(rows) == len(list(RESULTS.glob("*/*.json"))) > 0
    for row in rows:
        folder, name = row["file"].split("/")
        section = readme.split(f"\n## {folder}\n")[1].split("\n## ")[0]
        entry = section.split(f"- [`{name}`]({row['file']})")[1].split("\n- [")[0]
        assert row["date"][:10] in entry and row["git_sha"][:7] in entry, row["file"]
        assert "command" in entry
    # a vars(args) config gives the whole command back, the file where it lies now
    throughput = next(r for r in rows if r["file"] == "throughput/throughput_cpu_inflated.json")
    assert throughput["command_from"] == "reconstructed"
    assert throughput["command"].startswith("python -m benchmarks.throughput --target ")
    assert throughput["command"].endswith(" --out benchmarks/results/" + throughput["file"])


def test_results_lie_in_their_folders_under_unique_names_without_machine_paths():
    assert problems() == []
    assert find("testbed_cpu") == RESULTS / "testbed" / "testbed_cpu.json"


COMMITTED = json.loads(find("throughput_cpu_inflated").read_text())


def _tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict) -> Path:
    """A results tree of one throughput file, its config updated."""
    data = COMMITTED
    monkeypatch.setattr(results_paths, "RESULTS", tmp_path)
    (tmp_path / "throughput").mkdir(exist_ok=True)
    path = tmp_path / "throughput" / "throughput_cpu_inflated.json"
    path.write_text(json.dumps({**data, "config": {**data["config"], **config}}))
    return path


def test_a_machine_path_in_a_config_is_caught(tmp_path, monkeypatch):
    _tree(tmp_path, monkeypatch, {})
    assert problems() == []  # the control: the committed file, copied, passes
    bad = {"target": "/root/.cache/vllm_moa/pair/target", "drafter": ["/tmp/random_tp"]}
    _tree(tmp_path, monkeypatch, bad)
    found = problems()
    assert len(found) == 2 and "'/root/.cache/vllm_moa/pair/target'" in found[0]
    assert "'/tmp/random_tp'" in found[1]


def test_a_name_in_two_folders_or_a_file_in_another_folder_is_caught(tmp_path, monkeypatch):
    path = _tree(tmp_path, monkeypatch, {})
    (tmp_path / "testbed").mkdir()
    (tmp_path / "testbed" / path.name).write_text(path.read_text())
    found = problems()
    assert any("names must be unique" in p for p in found)
    assert any("a throughput result outside its folder" in p for p in found)
    with pytest.raises(SystemExit, match=r"matches testbed/throughput_cpu_inflated\.json, thr"):
        find("throughput_cpu_inflated")


def test_paths_are_written_relative_to_named_roots():
    roots = [("/home/u/.cache/vllm_moa", "$VLLM_MOA_CACHE"), ("/home/u/src/vllm_moa", "."),
             ("/home/u/src", ".."), ("/tmp", "$TMPDIR"), ("/home/u", "~")]  # fmt: skip
    config = {
        "target": "/home/u/.cache/vllm_moa/testbed-cpu/target",
        "drafters": ["moa=/home/u/.cache/vllm_moa/d", "/tmp/random_tp"],
        "candidates": "ngram,/home/u/models/eagle",
        "out": "/home/u/src/vllm_moa/benchmarks/results/x/x.json",
        "prompts": "/home/u/src/data/HumanEval.jsonl.gz",
        "not_a_root": "/tmpfoo/x",
        "k": 4,
    }
    assert portable({"config": config}, roots)["config"] == {
        "target": "$VLLM_MOA_CACHE/testbed-cpu/target",
        "drafters": ["moa=$VLLM_MOA_CACHE/d", "$TMPDIR/random_tp"],
        "candidates": "ngram,~/models/eagle",
        "out": "benchmarks/results/x/x.json",
        "prompts": "../data/HumanEval.jsonl.gz",
        "not_a_root": "/tmpfoo/x",
        "k": 4,
    }
    assert machine_paths({"config": portable(config, roots)}) == ["/tmpfoo/x"]
    # outside the config only a value that is a path counts (not a path quoted in a log line)
    assert machine_paths({"log": "read /tmp/x failed", "level": "/tmp/x"}) == ["/tmp/x"]


def test_a_run_writes_portable_paths_date_and_command_into_its_folder(tmp_path, monkeypatch):
    import argparse

    from benchmarks.testbed.report import add_out_argument, save_json

    monkeypatch.setenv("VLLM_MOA_CACHE", str(tmp_path / "cache"))
    p = argparse.ArgumentParser()
    add_out_argument(p, "standalone_adaptive")
    default = Path(p.parse_args([]).out)
    assert default.parent == RESULTS / "standalone" and default.stem.startswith("standalone_a")
    config = {"target": str(tmp_path / "cache" / "pair" / "target"), "out": str(default)}
    full = save_json(tmp_path / "r.json", "standalone_adaptive", {"config": config})
    assert full["config"] == {
        "target": "$VLLM_MOA_CACHE/pair/target",
        "out": f"benchmarks/results/standalone/{default.name}",
    }
    assert full["date"] and full["command"] is None  # run by pytest, not `python -m benchmarks`
    assert json.loads((tmp_path / "r.json").read_text()) == full


def test_a_marker_may_name_a_layout():
    compact = render_table("serve_sweep_cpu_inflated", "compact")
    assert compact.splitlines()[0].startswith("| requests/s | plain | MoA adaptive (default)")
    with pytest.raises(SystemExit, match="layout 'nope'"):
        render_table("serve_sweep_cpu_inflated", "nope")


def test_testbed_runs_merge_with_seeds_averaged():
    table = render_table("testbed_cpu_slim_k3_8,testbed_cpu_slim_k3_8_s1,testbed_cpu_slim_k3_8_s2")
    eagle = next(line for line in table.splitlines() if line.startswith("| EAGLE |"))
    # the three seeds' K=4 tau: 2.36, 2.37, 2.26 (mean 2.33)
    assert eagle.startswith("| EAGLE | 0, 1, 2 | 2.33 (2.36, 2.37, 2.26) |")
    assert "| MoA TLI=1, slim LSA, K ~ U[3, 8] | 0, 1, 2 | 2.75 " in table
