"""A pytest plugin (`-p tests.current_test`, as scripts/run_pytest.sh loads it): writes the id of
each test before it runs to the file named by VLLM_MOA_TEST_CURRENT, so that the test can be
named when pytest itself dies (native code ending the process, e.g. an illegal instruction,
leaves no summary)."""

from __future__ import annotations

import os

CURRENT_TEST_ENV = "VLLM_MOA_TEST_CURRENT"


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    path = os.environ.get(CURRENT_TEST_ENV)
    if path:
        with open(path, "w") as f:
            f.write(nodeid + "\n")
