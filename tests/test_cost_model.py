"""benchmarks/cost_model.py: the 8B cost model's script (tiny shapes on the CPU) and its
projection arithmetic."""

import json

import pytest

from benchmarks.cost_model import load_taus, main, project


def _measured(drafter: str) -> dict:
    """Hand-made timings (ms) and bytes for one drafter: decode 10, verify 12 / 13 / 20 (K=4,
    K=6, tree), proposals 4 / 6 / 9; target 100 GB and a draft step 5 GB at 1000 GB/s."""
    ms = {
        "decode": 10.0,
        "verify_k4": 12.0,
        "verify_k6": 13.0,
        "verify_tree": 20.0,
        "drafters": {
            drafter: {"chain_k1": 1.0, "chain_k4": 4.0, "chain_k6": 6.0, "tree": 9.0},
        },
    }
    nbytes = {"target_step": 100e9, "drafters": {drafter: {"draft_step": 5e9}}}
    return {"ms": ms, "copy_bandwidth_gb_s": 1000.0, "bytes": nbytes}


def test_projection_arithmetic():
    rows = {r["mode"]: r for r in project(_measured("eagle"), {"eagle": {"k4": 2.0}})}
    k4 = rows["k4"]
    assert k4["cycle_ms"] == 16.0 and k4["break_even_tau"] == 1.6
    assert k4["projected_speedup"] == pytest.approx(2.0 * 10.0 / 16.0)
    # memory-bound: decode 100 ms; a cycle reads the target once and the drafter 4 times
    assert k4["memory_bound_cycle_ms"] == pytest.approx(100.0 + 4 * 5.0)
    assert k4["memory_bound_projected_speedup"] == pytest.approx(2.0 * 100.0 / 120.0)
    assert "projected_speedup" not in rows["k6"]  # no tau for it
    assert rows["tree_d6_b8_m62"]["cycle_ms"] == 29.0


def test_slim_methods_are_projected_at_their_full_drafters_cost():
    taus = {"moa_tli1": {"k4": 2.0}, "moa_tli1_slim": {"k4": 2.5}}
    rows = project(_measured("moa_tli1"), taus)
    slim = [r for r in rows if r["drafter"] == "moa_tli1_slim"]
    assert [(r["mode"], r["cost_of"]) for r in slim] == [("k4", "moa_tli1")]  # only its taus
    assert slim[0]["cycle_ms"] == 16.0
    assert slim[0]["projected_speedup"] == pytest.approx(2.5 * 10.0 / 16.0)
    assert len([r for r in rows if r["drafter"] == "moa_tli1"]) == 3  # every mode, tau or not


@pytest.mark.slow
def test_cost_model_smoke(tmp_path):
    taus = tmp_path / "testbed.json"
    results = {
        "plain": {"tau": 1.0},
        "moa_tli1": {"k4": {"tau": 2.5}, "tree_d6_b8_m62": {"tau": 3.9}},
        "eagle": {"k4": {"tau": 2.3}},
    }
    taus.write_text(json.dumps({"results": results}))
    assert load_taus(taus)["moa_tli1"] == {"k4": 2.5, "tree_d6_b8_m62": 3.9}
    out = tmp_path / "cost.json"
    assert main(["--smoke", "--out", str(out), "--tau", str(taus)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "cost_model" and "git_sha" in report and "machine" in report
    drafters = report["ms"]["drafters"]
    assert set(drafters) == {
        "moa_tli0",
        "moa_tli1",
        "moa_tli3",
        "moa_no_lsa",
        "eagle",
        "independent",
    }
    assert report["verified_tree"]["nodes"] == 62
    assert "memory_rows_7" in drafters["moa_tli0"] and "memory_rows_1" not in drafters["eagle"]
    projected = {
        (r["drafter"], r["mode"]) for r in report["projection"] if "projected_speedup" in r
    }
    assert projected == {("moa_tli1", "k4"), ("moa_tli1", "tree_d6_b8_m62"), ("eagle", "k4")}
    assert all(r["break_even_tau"] > 0 for r in report["projection"])
    assert out.with_suffix(".png").is_file()

    # re-projected with other taus: same timings, machine and SHA; new speedups
    results["eagle"] = {"k4": {"tau": 4.6}}
    taus.write_text(json.dumps({"results": results}))
    again = tmp_path / "again.json"
    assert main(["--reproject", str(out), "--tau", str(taus), "--out", str(again)]) == 0
    redone = json.loads(again.read_text())
    assert redone["ms"] == report["ms"] and redone["machine"] == report["machine"]
    assert redone["git_sha"] == report["git_sha"] and "projected_at" in redone

    def speed(r: dict, name: str) -> float:
        return next(
            x["projected_speedup"]
            for x in r["projection"]
            if (x["drafter"], x["mode"]) == (name, "k4")
        )

    assert speed(redone, "eagle") == pytest.approx(2 * speed(report, "eagle"))
    assert again.with_suffix(".png").is_file()
