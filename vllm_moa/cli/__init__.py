"""The `vllm-moa` command line."""
