"""The MoA drafter: configuration, layers, masks and the model itself (no vLLM imports)."""

from vllm_moa.model.config import MoAConfig, TargetShape
from vllm_moa.model.kv_cache import KVCache
from vllm_moa.model.moa import MoADrafter, count_parameters
from vllm_moa.model.presets import PRESETS, TargetInfo, make_config

__all__ = [
    "PRESETS",
    "KVCache",
    "MoAConfig",
    "MoADrafter",
    "TargetInfo",
    "TargetShape",
    "count_parameters",
    "make_config",
]
