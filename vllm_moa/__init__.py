"""vllm_moa: Mixture of Attentions speculative decoding for vLLM, plus a standalone engine."""

__version__ = "0.1.0"
