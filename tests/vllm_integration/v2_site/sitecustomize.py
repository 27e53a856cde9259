"""Test-only (tests/vllm_integration/v2_on_cpu.py): on PYTHONPATH, every Python process installs
the V2 harness at start-up, before anything imports vLLM."""

import os

if os.environ.get("VLLM_MOA_TEST_V2") == "1":
    from tests.vllm_integration.v2_on_cpu import install

    install()
