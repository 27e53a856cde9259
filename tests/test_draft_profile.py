"""benchmarks/draft_profile.py's bookkeeping: a phase's parts add up to the phase, c is a draft
step over plain's step (the vLLM runs themselves are the benchmark's, not the suite's)."""

import pytest

from benchmarks.draft_profile import summarise, take, timed


def test_timers_accumulate_until_taken():
    calls = []
    f = timed("part", lambda x: calls.append(x) or x)
    assert f(1) == 1 and f(2) == 2 and calls == [1, 2]
    spent = take()
    assert set(spent) == {"part"} and spent["part"] >= 0
    assert take() == {}


def step(**parts):
    return {k: v / 1e3 for k, v in parts.items()}  # ms -> s, as the timers record


def test_parts_add_up_to_the_phase():
    moa = [
        {**step(step=300, phase=5, rows=60), "prefill": 1.0},  # the prompt's: apart
        step(step=50, phase=24, rows=2, read_kv=0.3, rows_math=1.3, draft_steps=21,
             drafter_step=18, lm_head=3, embed=0.4),
        step(step=40, phase=0),  # a step that drafted nothing: left out
    ]  # fmt: skip
    row = summarise("moa", moa, k=4)
    assert row["steps"] == 1
    assert row["prefill_step_ms"] == pytest.approx(300) and row["prefill_rows_ms"] == 60
    assert row["steps_per_request"] == 2 and row["request_ms"] == pytest.approx(390)
    parts = row["parts_ms"]
    assert parts["rows_write"] == pytest.approx(0.4)
    assert sum(parts.values()) == pytest.approx(24)  # "other" closes the sum
    assert row["target_step_ms"] == pytest.approx(26) and row["draft_step_ms"] == pytest.approx(
        5.25
    )
    eager = summarise(
        "moa_eager",
        [
            {**step(step=300), "prefill": 1.0},
            step(
                step=55,
                phase=27,
                rows=2,
                read_kv=0.3,
                rows_math=1.4,
                draft_steps=24,
                drafter_step=21,
                sa=10,
                ca=9,
                lm_head=3,
                embed=0.4,
                attend=1.5,
                write=0.3,
            ),
        ],
        k=4,
    )
    assert sum(eager["parts_ms"].values()) == pytest.approx(27)
    assert eager["attention_ms"] == pytest.approx(1.8)
    eagle = summarise(
        "eagle3",
        [
            {**step(step=280), "prefill": 1.0},
            step(step=49, phase=19, eagle_propose=18.7, lm_head=3),
        ],
        k=4,
    )
    assert eagle["parts_ms"]["eagle_layers"] == pytest.approx(15.7)
    assert sum(eagle["parts_ms"].values()) == pytest.approx(19)
    assert eagle["draft_step_ms"] == pytest.approx(19 / 4)
    plain = summarise(
        "plain", [{**step(step=250), "prefill": 1.0}, step(step=35), step(step=36)], k=4
    )
    assert plain == {
        "arm": "plain",
        "steps": 2,
        "engine_step_ms": pytest.approx(35.5),
        "prefill_step_ms": pytest.approx(250),
        "steps_per_request": 2,
        "request_ms": pytest.approx(321),
    }
