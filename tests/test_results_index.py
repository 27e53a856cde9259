"""The results index and the docs' generated tables are up to date with benchmarks/results/."""

from benchmarks.results_index import main, render_index


def test_index_and_generated_tables_are_fresh():
    assert main(["--check"]) == 0, "run `python -m benchmarks.results_index`"


def test_index_has_a_row_per_results_file_with_key_figures():
    rows = [line for line in render_index().splitlines() if line]
    sweep = next(r for r in rows if '"file": "serve_sweep_cpu_inflated.json"' in r)
    assert '"moa_tli0@inf"' in sweep and '"git_sha"' in sweep


def test_a_marker_may_name_a_layout():
    import pytest

    from benchmarks.results_index import render_table

    compact = render_table("serve_sweep_cpu_inflated", "compact")
    assert compact.splitlines()[0].startswith("| requests/s | plain | MoA adaptive (default)")
    with pytest.raises(SystemExit, match="layout 'nope'"):
        render_table("serve_sweep_cpu_inflated", "nope")


def test_testbed_runs_merge_with_seeds_averaged():
    from benchmarks.results_index import render_table

    table = render_table("testbed_cpu_slim_k3_8,testbed_cpu_slim_k3_8_s1,testbed_cpu_slim_k3_8_s2")
    eagle = next(line for line in table.splitlines() if line.startswith("| EAGLE |"))
    # the three seeds' K=4 tau: 2.36, 2.37, 2.26 (mean 2.33)
    assert eagle.startswith("| EAGLE | 0, 1, 2 | 2.33 (2.36, 2.37, 2.26) |")
    assert "| MoA TLI=1, slim LSA, K ~ U[3, 8] | 0, 1, 2 | 2.75 " in table
