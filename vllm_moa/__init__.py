"""vllm_moa: Mixture of Attentions speculative decoding for vLLM, plus a standalone engine."""

__version__ = "0.1.0"


def _map_checkout_kernels() -> None:
    """Run from a source checkout that is not installed (`python -m benchmarks...` on a bare GPU
    machine), `vllm_moa.kernels` is the repository's kernels/ folder, as pyproject's package-dir
    mapping makes it for installs (which ship vllm_moa/kernels/ and skip this)."""
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    source = here.parent / "kernels"
    if (
        "vllm_moa.kernels" in sys.modules
        or (here / "kernels").is_dir()
        or not (source / "__init__.py").is_file()
        or not (here.parent / "pyproject.toml").is_file()
    ):
        return
    spec = importlib.util.spec_from_file_location(
        "vllm_moa.kernels", source / "__init__.py", submodule_search_locations=[str(source)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_moa.kernels"] = module
    spec.loader.exec_module(module)


_map_checkout_kernels()
