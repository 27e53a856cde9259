"""vLLM integration: the `moa` speculative method for unmodified vLLM 0.32.0, 0.33.0 and 0.34.0.

The only package that imports vLLM. `register()` is the `vllm.general_plugins` entry point,
called by vLLM in every process it starts (API server, engine core, workers) before models and
runners are built: it checks the vLLM version and wires MoA in the way that release allows
(releases.py): on 0.32 / 0.33 it installs the patches (patches.py); on 0.34 it registers the
method through vLLM's own `register_speculative_method` (registry_034.py). Cheap and idempotent;
no CUDA is touched. On a vLLM release it does not support it installs nothing and logs why, once
per process: the plugin loads in every vLLM process, so raising there would break all serving in
that environment, MoA or not; without the method vLLM refuses `"method": "moa"` like any unknown
method, and the warning beside it says why.
"""

from __future__ import annotations

from vllm_moa.vllm_plugin.releases import (
    SUPPORTED_VLLM_VERSIONS,
    UnsupportedVllmVersionError,
    check_vllm_version,
)
from vllm_moa.vllm_plugin.spec_config import METHOD

__all__ = [
    "METHOD",
    "SUPPORTED_VLLM_VERSIONS",
    "UnsupportedVllmVersionError",
    "check_vllm_version",
    "register",
]


def register() -> None:
    import logging

    from vllm_moa.vllm_plugin import releases
    from vllm_moa.vllm_plugin.logs import LOGGER_NAME

    try:
        release = releases.check_vllm_version()
    except UnsupportedVllmVersionError as e:
        logging.getLogger(LOGGER_NAME).warning(
            "the speculative method %r is not available: %s Other methods and plain decoding "
            "are unaffected.", METHOD, e,
        )  # fmt: skip
        return
    if release in releases.REGISTERED_RELEASES:
        from vllm_moa.vllm_plugin import registry_034

        registry_034.register()
        return
    from vllm_moa.vllm_plugin import patches

    patches.apply()
