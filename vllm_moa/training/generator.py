"""What answers `vllm-moa regenerate`'s prompts: the seam between the run
(training/regenerate.py) and vLLM (training/vllm_offline.py), or a stand-in in tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]  # the rendered prompt
    seed: int  # its sampling seed (`prompt_seed`)


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int
    finish_reason: str  # "stop" (EOS / a stop token) or "length" (max_tokens or the context)


class Generator(Protocol):
    """What answers the prompts: vLLM (training/vllm_offline.py), or a stand-in in tests."""

    @property
    def max_model_len(self) -> int: ...

    def generate(self, requests: Sequence[Request]) -> list[Completion]: ...
