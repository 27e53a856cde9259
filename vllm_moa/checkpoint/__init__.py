"""Drafter checkpoint I/O and import of the authors' released layouts (MoA's, EAGLE-3's)."""

from vllm_moa.checkpoint.convert import convert_official
from vllm_moa.checkpoint.io import load_config, load_drafter, save_drafter
from vllm_moa.checkpoint.official import ConvertOptions

__all__ = ["ConvertOptions", "convert_official", "load_config", "load_drafter", "save_drafter"]
