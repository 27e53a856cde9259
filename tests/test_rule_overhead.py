"""benchmarks/rule_overhead.py drives both rules as an engine would: with acceptance high and
drafting cheap on its fake clock, both keep drafting K, and a useless drafter's steps end at 0
(the run itself, timing included, is the benchmark's, not the suite's)."""

import json

from benchmarks.rule_overhead import main


def rows_of(tmp_path, *flags):
    out = tmp_path / "ro.json"
    main(["--out", str(out), "--batch-sizes", "1", "8", "--steps", "40", "--warmup", "60", *flags])
    assert out.with_suffix(".png").exists()
    return {(r["arm"], r["batch"]): r for r in json.loads(out.read_text())["results"]}


def test_both_rules_draft_k_when_drafts_land(tmp_path):
    rows = rows_of(tmp_path)
    assert set(rows) == {("v1", 1), ("v2", 1), ("v1", 8), ("v2", 8)}
    assert all(r["drafts_chosen_mean"] == 4.0 and r["us_per_step"] > 0 for r in rows.values())


def test_a_useless_drafter_stops_drafting(tmp_path):
    """Control: the fake clock and verdicts reach the rules (else they would keep K)."""
    rows = rows_of(tmp_path, "--acceptance", "0.01", "--draft-ms", "10")
    assert all(r["drafts_chosen_mean"] < 1.0 for r in rows.values())
