"""What answers `vllm-moa regenerate`'s prompts: the seam between the run
(training/regenerate.py) and vLLM (vllm_plugin/offline_generation.py), or a stand-in in tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]  # the rendered prompt
    seed: int  # its sampling seed (`prompt_seed`)


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int
    finish_reason: str  # "stop" (EOS / a stop token) or "length" (max_tokens or the context)


@runtime_checkable
class Generator(Protocol):
    """What answers the prompts: vLLM (vllm_plugin/offline_generation.py), or a test stand-in."""

    @property
    def max_model_len(self) -> int: ...

    def generate(self, requests: Sequence[Request]) -> list[Completion]: ...
