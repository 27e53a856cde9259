"""Adaptive speculation with its measurements replaced, for tests whose real timings would
mislead the rule (an oracle drafter that runs the whole target, Triton interpreted on V2)."""

from __future__ import annotations

from vllm_moa.adaptive import StepCosts


def fixed_costs(
    draft_step: float,
    verify_base: float = 0.02,
    verify_per_token: float = 0.0001,
    fixed_prefill: bool = False,
) -> type[StepCosts]:
    """A `StepCosts` class that learns a draft step of `draft_step` seconds and a verify step of
    `verify_base + verify_per_token * tokens` seconds whatever it is told was measured. Replace
    the class where the engine under test makes its cost model (e.g. `monkeypatch.setattr(
    proposer, "StepCosts", fixed_costs(0.001))`); in a vLLM process, from a setup string
    (`costs_setup`).
    `fixed_prefill`: prompt steps are learnt at the verify step's line too (by default their
    measured time is learnt, and it bounds the cost of verify steps larger than any seen, so
    the draft lengths chosen may still follow this machine's timings)."""

    class FixedCosts(StepCosts):
        def observe_draft(
            self, steps: int, seconds: float, drafts: int | None = None, rows: int = 0
        ) -> None:
            super().observe_draft(1, draft_step)

        def observe_verify(self, tokens: int, seconds: float) -> None:
            super().observe_verify(tokens, verify_base + verify_per_token * tokens)

        def observe_prefill(self, tokens: int, seconds: float) -> None:
            if fixed_prefill:
                seconds = verify_base + verify_per_token * tokens
            super().observe_prefill(tokens, seconds)

    return FixedCosts


def costs_setup(module: str, step_costs: str, defs: str = "") -> str:
    """Setup source for a vLLM process (a run's "setup" in chains.py's `ENGINES`, or every
    process through `worker_setup_env`) that replaces the `StepCosts` of `module` (where the
    engine under test makes its cost model), read there as `_<its last name>`, by `step_costs`:
    a Python expression, which may call `_fixed_costs` (`fixed_costs` above) and name what `defs`
    defines (source run after the imports, before the replacement; other patches may go there)."""
    alias = "_" + module.rpartition(".")[2]
    return (
        f"import {module} as {alias}\n"
        "from tests.costs import fixed_costs as _fixed_costs\n"
        f"{defs}"
        f"{alias}.StepCosts = {step_costs}\n"
    )
