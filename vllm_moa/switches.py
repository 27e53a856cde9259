"""On / off / auto switches read from environment variables (`VLLM_MOA_KERNELS`,
`VLLM_MOA_COMPILE`, ...): one spelling for all of them."""

from __future__ import annotations

import os


def env_switch(name: str) -> bool | None:
    """True for 1/on/true/yes, False for 0/off/false/no, None for auto (also when unset);
    anything else is refused with the variable's name."""
    mode = os.environ.get(name, "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return False
    if mode in ("1", "on", "true", "yes"):
        return True
    if mode != "auto":
        raise ValueError(f"{name}={mode!r}: use auto, 1 or 0")
    return None
