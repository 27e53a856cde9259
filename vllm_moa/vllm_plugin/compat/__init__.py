"""Release checking, apart from the plugin's runtime: every vLLM internal the plugin relies on
(`symbols.py`) and the check of a release's source for them (`source_check.py`, also
`python -m vllm_moa.vllm_plugin.compat.source_check WHEEL_OR_DIR`). Nothing here imports vLLM and
nothing of the runtime imports this package."""
