"""tests/deps.py: an optional test dependency skips where missing, but fails under CI."""

from __future__ import annotations

import pytest

from tests.deps import REQUIRE_ENV, need


def test_a_missing_dependency_skips_on_a_developers_machine(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception):
        need("vllm_moa_no_such_module")


def test_a_missing_dependency_fails_under_ci(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(ModuleNotFoundError):
        need("vllm_moa_no_such_module")
    assert need("torch").__name__ == "torch"  # control: a present one is returned
