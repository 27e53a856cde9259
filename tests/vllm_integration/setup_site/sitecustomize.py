"""Test-only (tests/vllm_integration/chains.py, `worker_setup_env`): on PYTHONPATH, every Python
process runs the source in VLLM_MOA_TEST_SETUP at start-up. vLLM's CPU platform spawns its
tensor-parallel workers, so a patch made in the parent never reaches them; this one does."""

import os

_source = os.environ.get("VLLM_MOA_TEST_SETUP")
if _source:
    exec(_source)
