"""vLLM integration: the `moa` speculative method for unmodified vLLM 0.32.0 and 0.33.0.

The only package that imports vLLM. `register()` is the `vllm.general_plugins` entry point,
called by vLLM in every process it starts (API server, engine core, workers) before models and
runners are built: it checks the vLLM version and installs the patches (patches.py). Cheap and
idempotent; no CUDA is touched. On a vLLM release it does not support it installs nothing and
logs why, once per process: the plugin loads in every vLLM process, so raising there would break
all serving in that environment, MoA or not; without the patches vLLM refuses `"method": "moa"`
like any unknown method, and the warning beside it says why.
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
    import logging

    from vllm_moa.vllm_plugin import patches
    from vllm_moa.vllm_plugin.logs import LOGGER_NAME

    try:
        patches.check_vllm_version()
    except UnsupportedVllmVersionError as e:
        logging.getLogger(LOGGER_NAME).warning(
            "the speculative method %r is not available: %s Other methods and plain decoding "
            "are unaffected.", METHOD, e,
        )  # fmt: skip
        return
    patches.apply()
