"""Training data: read files into token sequences with loss masks, and batch them.

Which files and layouts are read: `data_files` (JSONL, Parquet, Arrow, `save_to_disk`
directories, plain text) and `records` (`messages`, ShareGPT `conversations`, UltraChat `data`,
prompt/response pairs, `text`). Per record:
- a chat: rendered with the tokenizer's chat template; loss on the assistant turns only.
- a prompt/response pair: loss on the response + EOS.
- text: loss on every token, cut into `max_length` chunks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_moa.training.data_files import read_records
from vllm_moa.training.records import Chat, Pair, Record


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    loss_mask: list[bool]  # per token: True where the token is a training target
    prompt_len: int  # first response position (draft cycles start here)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T] bool, False on padding
    loss_mask: torch.Tensor  # [B, T] bool: position t is trained to predict token t+1
    prompt_len: torch.Tensor  # [B]


def _chat_example(tokenizer: Any, messages: list[dict[str, Any]]) -> Example:
    """Assistant turns are the tokens each adds to the rendered conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat data (`messages`) needs a tokenizer with a chat template")

    def render(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    ids = render(messages, gen=False)
    mask = [False] * len(ids)
    starts = []
    for i, msg in enumerate(messages):
        if msg.get("role") == "assistant":
            start = len(render(messages[:i], gen=True))
            end = len(render(messages[: i + 1], gen=False))
            mask[start:end] = [True] * (end - start)
            starts.append(start)
    if not starts:
        raise ValueError("a chat example has no assistant message to train on")
    return Example(ids, mask, starts[0])


def _pair_example(tokenizer: Any, prompt: str, response: str) -> Example:
    p = tokenizer(prompt)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        r = [*r, tokenizer.eos_token_id]
    return Example(p + r, [False] * len(p) + [True] * len(r), len(p))


def _text_examples(tokenizer: Any, text: str, max_length: int) -> list[Example]:
    ids = tokenizer(text)["input_ids"]
    chunks = [ids[i : i + max_length] for i in range(0, len(ids), max_length)]
    return [Example(c, [True] * len(c), 0) for c in chunks if len(c) >= 2]


def _record_examples(tokenizer: Any, record: Record, max_length: int) -> list[Example]:
    if isinstance(record, Chat):
        return [_chat_example(tokenizer, record.messages)]
    if isinstance(record, Pair):
        return [_pair_example(tokenizer, record.prompt, record.response)]
    return _text_examples(tokenizer, record.text, max_length)


def load_examples(paths: Sequence[str | Path], tokenizer: Any, max_length: int) -> list[Example]:
    """Read every path into examples truncated to max_length (paths in the given order)."""
    examples: list[Example] = []
    for path in paths:
        for record in read_records(Path(path)):
            examples += _record_examples(tokenizer, record, max_length)
    out = [
        Example(e.input_ids[:max_length], e.loss_mask[:max_length], min(e.prompt_len, max_length))
        for e in examples
    ]
    out = [e for e in out if any(e.loss_mask[1:])]
    if not out:
        raise ValueError(f"no trainable tokens in {[str(p) for p in paths]}")
    return out


def collate(examples: Sequence[Example], pad_id: int = 0) -> Batch:
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.bool)
    target = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        attn[i, :n] = True
        # Position t predicts token t+1: train where that next token is a target.
        target[i, : n - 1] = torch.tensor(e.loss_mask[1:n], dtype=torch.bool)
    prompt = torch.tensor([e.prompt_len for e in examples])
    return Batch(ids, attn, target, prompt)


def epoch_batches(
    examples: Sequence[Example], batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Length-bucketed batches of example indices, shuffled deterministically per epoch."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(examples)))
    rng.shuffle(order)
    # Sort within windows of 50 batches so a batch holds similar lengths (less padding).
    window = batch_size * 50
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(examples[i].input_ids))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches
