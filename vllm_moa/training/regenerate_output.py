"""The files `vllm-moa regenerate` writes, and how a run resumes from them.

- `OUT.jsonl`: one record a line, each carrying `id`, `source`, `category` beside the training
  layout; appended a chunk at a time, flushed and fsynced, so a killed run loses at most the
  chunk in flight and a half-written last line, which `resume` cuts away.
- `OUT.held_out.jsonl`: the held-out prompts (`id`, `source`, `category`, `prompt`), rewritten
  whole (atomically) by every run; `prompt` is the field the benchmarks' prompt readers take,
  and `train --data` refuses such a record (a prompt with no response).
- `OUT.settings.json`: the settings the responses depend on; a resumed run must give the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_moa.training.prompts import Prompt
from vllm_moa.training.regenerate_config import RegenerateConfig


@dataclass(frozen=True)
class Resumed:
    ids: frozenset[str]  # prompts already answered in OUT
    truncated_bytes: int  # of a half-written last line, cut away


def resume(path: Path) -> Resumed:
    """The ids already in `path`, after cutting a half-written last line (from a kill) away."""
    if not path.exists():
        return Resumed(frozenset(), 0)
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    ids: set[str] = set()
    for n, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{n} is not valid JSON ({e}) and is not the last line (which a killed "
                "run can leave half-written): delete that line, or give a new --out"
            ) from None
        rid = record.get("id") if isinstance(record, dict) else None
        if not isinstance(rid, str):
            raise ValueError(
                f"{path}:{n} has no string `id`: {path} was not written by `vllm-moa "
                "regenerate`; give a new --out"
            )
        ids.add(rid)
    return Resumed(frozenset(ids), len(data) - end)


def check_settings(config: RegenerateConfig, resumed: Resumed) -> None:
    """Refuse to add responses made with other settings to a file holding some; else record
    this run's settings."""
    path, now = config.settings_path, config.response_settings()
    if resumed.ids and path.exists():
        before = json.loads(path.read_text())
        for name, value in now.items():
            if before.get(name) != value:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{config.out} holds {len(resumed.ids)} responses made with {name}="
                    f"{before.get(name)!r} ({path}), this run has {value!r}: give {flag} as "
                    "before to resume, or a new --out"
                )
    path.write_text(json.dumps(now, indent=2) + "\n")


def refuse_held_out_records(config: RegenerateConfig, resumed: Resumed, excluded: set[str]) -> None:
    """A record already in OUT for a prompt this run holds out (another --hold-out, new files):
    training on it would leak the evaluation set."""
    leaked = sorted(resumed.ids & excluded)
    if leaked:
        raise ValueError(
            f"{config.out} holds {len(leaked)} responses to prompts this run holds out (e.g. "
            f"{leaked[0]}): the held-out set changed (--hold-out, or the prompt files); give "
            "the same as before, or a new --out"
        )


def write_held_out(path: Path, prompts: Sequence[Prompt]) -> None:
    lines = [
        json.dumps(
            {"id": p.id, "source": p.source, "category": p.category, "prompt": p.text},
            ensure_ascii=False,
        )
        + "\n"
        for p in prompts
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, path)


def append_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append `records`, one a line, and make them durable before returning."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    with path.open("ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
