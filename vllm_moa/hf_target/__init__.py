"""Target adapters: drive a Hugging Face causal LM for speculative decoding (no vLLM imports)."""

from vllm_moa.hf_target.adapter import (
    SUPPORTED_MODEL_TYPES,
    HFTarget,
    TargetOutput,
    check_supported,
    target_shape,
)
from vllm_moa.hf_target.info import load_target_info

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFTarget",
    "TargetOutput",
    "check_supported",
    "load_target_info",
    "target_shape",
]
