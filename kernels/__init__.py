"""Triton kernels (imported as `vllm_moa.kernels`; sources live in the repository's kernels/)."""
