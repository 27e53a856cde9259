"""vLLM integration: the `moa` speculative method for unmodified vLLM 0.32.0 and 0.33.0.

The only package that imports vLLM. `register()` is the `vllm.general_plugins` entry point,
called by vLLM in every process it starts (API server, engine core, workers) before models and
runners are built: it checks the vLLM version and installs the patches (patches.py). Cheap and
idempotent; no CUDA is touched.
"""

from __future__ import annotations

from vllm_moa.vllm_plugin.patches import (
    METHOD,
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVllmVersionError,
    check_vllm_version,
)

__all__ = [
    "METHOD",
    "SUPPORTED_VLLM_VERSIONS",
    "UnsupportedVllmVersionError",
    "check_vllm_version",
    "register",
]


def register() -> None:
    from vllm_moa.vllm_plugin import patches

    patches.apply()
