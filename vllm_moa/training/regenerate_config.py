"""`vllm-moa regenerate` settings: one frozen dataclass; the CLI's flags are built from its fields
(vllm_moa/cli/main.py `add_dataclass_flags`, as `train`'s from TrainConfig)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# The settings a response depends on: a resumed run must give the same ones (regenerate_output.py).
RESPONSE_FIELDS = (
    "target",
    "dtype",
    "max_tokens",
    "temperature",
    "seed",
    "system",
    "chat_template",
)


@dataclass(frozen=True)
class RegenerateConfig:
    target: str = field(metadata={"help": "target model directory (Hugging Face)"})
    prompts: tuple[str, ...] = field(
        metadata={
            "help": "prompt files (JSONL, .gz too): Spec-Bench / MT-Bench `turns`, HumanEval, "
            "GSM8K `question`, `prompt` or `messages` records (docs/training.md)"
        }
    )
    out: str = field(
        metadata={
            "help": "output FILE.jsonl of chat records for `train --data`; appended to and "
            "resumed; FILE.held_out.jsonl and FILE.settings.json are written beside it"
        }
    )
    max_tokens: int = field(default=256, metadata={"min": 1, "help": "tokens per response"})
    temperature: float = field(
        default=0.7,
        metadata={
            "help": "sampling temperature (default 0.7, SpecForge's: the training loss is the KL "
            "to the target's whole distribution at every position, so the sampling only picks "
            "which contexts the drafter sees; sampled contexts are what it meets when serving "
            "with sampling and avoid greedy's repetition loops; 0 = greedy, contexts of greedy "
            "serving only)"
        },
    )
    hold_out: float = field(
        default=0.5,
        metadata={
            "help": "fraction of each evaluation file (Spec-Bench, MT-Bench, the 6-task set, "
            "HumanEval) kept for evaluation, chosen by a hash of each prompt's text, listed in "
            "FILE.held_out.jsonl and never regenerated; training files (GSM8K train, plain "
            "prompts) are used whole"
        },
    )
    limit: int | None = field(
        default=None, metadata={"min": 1, "help": "at most N training prompts per file"}
    )
    batch_size: int = field(
        default=64,
        metadata={"min": 1, "help": "prompts submitted to vLLM at a time; written after each"},
    )
    dtype: Dtype = field(default="auto", metadata={"help": "vLLM's dtype (auto: the checkpoint's)"})
    seed: int = field(
        default=0,
        metadata={"help": "sampling seed: each prompt's is derived from it and the prompt's id"},
    )
    system: str | None = field(
        default=None, metadata={"help": "a system message before each prompt (chat template)"}
    )
    chat_template: bool = field(
        default=True,
        metadata={
            "help": "render prompts with the target's chat template (default); "
            "--no-chat-template sends the raw prompt and writes prompt/response records"
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "help": "vLLM's context length (default: the model's); longer prompts are skipped",
        },
    )
    kv_cache_gib: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "help": "vLLM on CPU: KV cache GiB (sets VLLM_CPU_KVCACHE_SPACE; default: the "
            "environment's, else 4: vLLM's own sizing refuses to start where 0.92 of the "
            "memory is not free)",
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "no compilation or CUDA graphs: quicker start, slower generation"},
    )

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("give at least one prompt file (--prompts FILE ...)")
        if not self.out.endswith(".jsonl"):
            raise ValueError(
                f"out must be a .jsonl file, got {self.out!r}: `train --data` reads JSON records "
                "only from .jsonl/.json files (any other file is plain text)"
            )
        if self.dtype not in get_args(Dtype):
            raise ValueError(f"dtype must be one of {list(get_args(Dtype))}, got {self.dtype!r}")
        if not 0.0 <= self.hold_out <= 1.0:
            raise ValueError(f"hold_out must be a fraction in [0, 1], got {self.hold_out}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        for name in ("max_tokens", "batch_size", "limit", "max_model_len", "kv_cache_gib"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.system is not None and not self.chat_template:
            raise ValueError(
                "--system needs the chat template: drop --no-chat-template, or put the system "
                "text into the prompts"
            )

    @property
    def held_out_path(self) -> Path:
        return Path(self.out.removesuffix(".jsonl") + ".held_out.jsonl")

    @property
    def settings_path(self) -> Path:
        return Path(self.out.removesuffix(".jsonl") + ".settings.json")

    def response_settings(self) -> dict[str, Any]:
        """The fields a response depends on (`RESPONSE_FIELDS`), the target's path resolved."""
        values = {name: getattr(self, name) for name in RESPONSE_FIELDS}
        values["target"] = str(Path(self.target).resolve())
        return values

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
