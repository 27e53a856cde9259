"""Prompt files for `vllm-moa regenerate`: every record one `Prompt` with an id stable across runs.

A file holds JSON records, one a line (`.jsonl`, `.json`, optionally gzipped), all in one
layout, told apart by its first record's keys:

- `turns`: Spec-Bench, MT-Bench, the MoA paper's 6-task set (`question_id`, `category`,
  `turns`); the prompt is the first turn. Evaluation.
- `humaneval`: HumanEval (`task_id`, `prompt`). Evaluation.
- `question`: GSM8K (`question`, `answer`). Training.
- `messages`: chat records; the prompt is the first user message. Training.
- `prompt`: `{"prompt": ...}`. Training.

Evaluation sets are the benchmarks' layouts: part of each is held out (training/hold_out.py).
A prompt's id is `SOURCE:LINE`, the file's name without `.jsonl`/`.json`/`.gz` and the record's
line (from 0): the same file gives the same ids, so a resumed run knows what it has done.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vllm_moa.training.data_files import read_jsonl

Layout = Literal["turns", "humaneval", "question", "messages", "prompt"]
EVALUATION_LAYOUTS: frozenset[str] = frozenset({"turns", "humaneval"})
# What `regenerate` writes as its held-out list (training/regenerate_output.py): evaluation
# prompts, refused as training material.
HELD_OUT_KEYS = frozenset({"id", "source", "category", "prompt"})


@dataclass(frozen=True)
class Prompt:
    id: str  # SOURCE:LINE, stable across runs
    source: str  # the file's name without .jsonl / .json / .gz
    category: str  # the record's `category`, else the source
    text: str  # the prompt (the first user turn)


@dataclass(frozen=True)
class PromptFile:
    path: Path
    source: str
    layout: Layout
    evaluation: bool  # a benchmark's layout: part of it is held out
    prompts: tuple[Prompt, ...]  # in file order


def source_name(path: Path) -> str:
    """`HumanEval.jsonl.gz` -> `HumanEval`, `moa_eval6/gsm8k.jsonl` -> `gsm8k`."""
    name = path.name.removesuffix(".gz")
    return name.removesuffix(".jsonl").removesuffix(".json")


def read_prompt_file(path: Path) -> PromptFile:
    """Every record of `path` as a Prompt (errors name `file:line` and the fix)."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    if not path.name.removesuffix(".gz").endswith((".jsonl", ".json")):
        raise ValueError(
            f"prompt file {path}: expected JSON records one a line (.jsonl, .json, optionally "
            '.gz), e.g. {{"prompt": ...}}; see docs/training.md for the layouts read'
        )
    source = source_name(path)
    layout: Layout | None = None
    prompts: list[Prompt] = []
    for line, record in _records(path):
        where = f"{path}:{line + 1}"
        found = _layout(record, where)
        if layout is None:
            layout = found
        elif found != layout:
            raise ValueError(
                f"{where}: a `{found}` record in a file of `{layout}` records (its first "
                "record's layout); a prompt file holds one layout: split the file"
            )
        category = record.get("category") or source
        text = _text(record, found, where)
        prompts.append(Prompt(f"{source}:{line}", source, str(category), text))
    if layout is None:
        raise ValueError(f"prompt file {path} holds no records")
    return PromptFile(path, source, layout, layout in EVALUATION_LAYOUTS, tuple(prompts))


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line index from 0, record) of each non-blank line."""
    for n, record in read_jsonl(path):
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}:{n}: a record must be a JSON object, got {type(record).__name__}"
            )
        yield n - 1, record


def _layout(record: dict[str, Any], where: str) -> Layout:
    keys = {k for k, v in record.items() if v is not None}
    if keys == HELD_OUT_KEYS:
        raise ValueError(
            f"{where} is a held-out list written by `vllm-moa regenerate`: its prompts are "
            "kept for evaluation and never regenerated for training; give the original files"
        )
    if "turns" in keys:
        return "turns"
    if "task_id" in keys and "prompt" in keys:
        return "humaneval"
    if "messages" in keys:
        return "messages"
    if "question" in keys:
        return "question"
    if "prompt" in keys:
        return "prompt"
    raise ValueError(
        f"{where}: record with keys {sorted(record)[:6]} has none of `turns` (Spec-Bench, "
        "MT-Bench), `task_id`+`prompt` (HumanEval), `question` (GSM8K), `messages` or "
        "`prompt`; see docs/training.md for the prompt layouts"
    )


def _text(record: dict[str, Any], layout: Layout, where: str) -> str:
    if layout == "turns":
        turns = record["turns"]
        value = turns[0] if isinstance(turns, list) and turns else None
        name = "`turns[0]`"
    elif layout == "messages":
        users = [m for m in record["messages"] if isinstance(m, dict) and m.get("role") == "user"]
        value = users[0].get("content") if users else None
        name = "the first user message's `content`"
    else:
        key = "prompt" if layout == "humaneval" else layout
        value, name = record[key], f"`{key}`"
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {name} must be a non-empty string, got {value!r:.60}")
    return value
