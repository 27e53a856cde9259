"""Drafter checkpoint I/O and import of the authors' released layout."""

from vllm_moa.checkpoint.io import load_config, load_drafter, save_drafter
from vllm_moa.checkpoint.official import ConvertOptions, convert_official

__all__ = ["ConvertOptions", "convert_official", "load_config", "load_drafter", "save_drafter"]
