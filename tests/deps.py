"""Optional test dependencies: skipped where missing on a developer's machine, required in CI.

CI (`scripts/test.sh`, which `.ci/run` calls) installs every dependency and sets
`VLLM_MOA_TEST_REQUIRE_ALL=1`: there a missing vLLM, Triton, Ray or openai is a broken install,
and the import fails the tests that need it instead of skipping them (a skipped vLLM suite used
to leave CI green)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRE_ENV = "VLLM_MOA_TEST_REQUIRE_ALL"


def need(name: str, reason: str | None = None) -> ModuleType:
    """The module `name`: under CI (`VLLM_MOA_TEST_REQUIRE_ALL=1`) imported, failing if missing;
    elsewhere `pytest.importorskip`."""
    if os.environ.get(REQUIRE_ENV) == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=reason)
