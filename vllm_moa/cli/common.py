"""What several `vllm-moa` subcommands share: the device and dtype flags, prompts."""

from __future__ import annotations

import argparse
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def runtime(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    from vllm_moa.devices import resolve_device

    device = resolve_device(args.device)
    if args.dtype == "auto":
        return device, torch.bfloat16 if device.startswith("cuda") else torch.float32
    return device, _DTYPES[args.dtype]


def encode_prompt(tokenizer: Any, prompt: str, chat: bool, target_dir: str) -> list[int]:
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not tokenizer.chat_template:
        raise ValueError(f"--chat given but the tokenizer in {target_dir} has no chat template")
    messages = [{"role": "user", "content": prompt}]
    ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
