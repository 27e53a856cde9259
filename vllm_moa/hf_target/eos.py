"""A target's end-of-sequence ids: its tokenizer's and its generation config's, together."""

from __future__ import annotations

from typing import Any


def eos_ids(tokenizer: Any, model: Any) -> list[int]:
    """The end ids of a loaded model (its `generation_config`) and its tokenizer."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return sorted(ids)


def eos_ids_of(target_dir: str, tokenizer: Any) -> list[int]:
    """The target's end-of-sequence ids without loading its weights."""
    from transformers import GenerationConfig

    try:
        generation: Any = GenerationConfig.from_pretrained(target_dir)
    except OSError:
        generation = None
    return eos_ids(tokenizer, type("Model", (), {"generation_config": generation})())
