"""The plugin's logger name: under vLLM's own (`vllm.`), so vLLM's logging configuration and
its `VLLM_LOGGING_LEVEL` apply to MoA's messages too. Its own module, below every other one of
the plugin, so that any of them can log without importing the patches."""

LOGGER_NAME = "vllm.moa"
