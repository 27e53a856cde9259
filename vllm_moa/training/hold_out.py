"""Which prompts `vllm-moa regenerate` keeps for evaluation, and which it regenerates for training.

The rule, a function of each prompt's text alone (never of the run, the file's order or the
other files given):

- a prompt of an evaluation file (training/prompts.py: Spec-Bench, MT-Bench, the MoA paper's
  6-task set, HumanEval) is held out iff `score(text) < fraction`, where `score` is SHA-256 of
  the prompt's canonical text read as a number in [0, 1). The same problem in two files gets one
  decision: Spec-Bench holds the 6-task set's mt_bench, qa and summarization prompts, and the
  6-task set's humaneval prompts are HumanEval's behind "Complete the code I provided."
  (`KNOWN_PREFIXES`). Raising the fraction only adds prompts to the held-out set;
- a prompt of a training file (GSM8K train, plain prompts, chat records) is never held out;
- a prompt not held out but equal to a held-out one, containing one, or contained in one
  (canonical texts of `MIN_OVERLAP_CHARS` or more) is left out of training as well ("overlapping"):
  no held-out problem reaches training in another file's wrapping;
- of the rest, a prompt whose canonical text came earlier is a duplicate, regenerated once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_moa.training.prompts import Prompt, PromptFile

SALT = b"vllm-moa hold-out v1\x00"  # a new salt would be a new split: never change it
# Instructions a benchmark wraps another's prompts in (canonical form): the MoA paper's
# humaneval.jsonl puts this before HumanEval's prompts.
KNOWN_PREFIXES = ("complete the code i provided.",)
MIN_OVERLAP_CHARS = 24  # shorter canonical texts are compared for equality only


@dataclass(frozen=True)
class Split:
    train: tuple[Prompt, ...]  # to regenerate: in file order, at most `limit` per file
    held_out: tuple[Prompt, ...]  # evaluation prompts, never trained on, in file order
    overlapping: tuple[Prompt, ...]  # not held out, but overlapping a held-out prompt
    duplicates: int  # training prompts whose text an earlier one already has


def canonical(text: str) -> str:
    """Whitespace collapsed, lower case, a known wrapper instruction removed."""
    key = " ".join(text.replace("\x00", " ").split()).lower()
    for prefix in KNOWN_PREFIXES:
        key = key.removeprefix(prefix).lstrip()
    return key


def score(text: str) -> float:
    """A uniform number in [0, 1) fixed by the prompt's canonical text."""
    digest = hashlib.sha256(SALT + canonical(text).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_held_out(prompt: Prompt, evaluation: bool, fraction: float) -> bool:
    return evaluation and score(prompt.text) < fraction


def split_prompts(files: Sequence[PromptFile], fraction: float, limit: int | None) -> Split:
    """The held-out and training prompts of `files` (`limit`: training prompts per file)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"hold_out must be a fraction in [0, 1], got {fraction}")
    held_out = [p for f in files for p in f.prompts if is_held_out(p, f.evaluation, fraction)]
    overlaps = _Overlaps([canonical(p.text) for p in held_out])
    held_ids = {p.id for p in held_out}
    train: list[Prompt] = []
    overlapping: list[Prompt] = []
    seen: set[str] = set()
    duplicates = 0
    for f in files:
        taken = 0
        for p in f.prompts:
            if limit is not None and taken >= limit:
                break
            if p.id in held_ids:
                continue
            key = canonical(p.text)
            if overlaps.touches(key):
                overlapping.append(p)
            elif key in seen:
                duplicates += 1
            else:
                seen.add(key)
                train.append(p)
                taken += 1
    return Split(tuple(train), tuple(held_out), tuple(overlapping), duplicates)


class _Overlaps:
    """Does a canonical text equal, contain or lie inside one of the held-out texts?"""

    def __init__(self, keys: list[str]) -> None:
        self.equal = set(keys)
        self.long = [k for k in keys if len(k) >= MIN_OVERLAP_CHARS]
        self.joined = "\x00".join(self.long)  # one search for "inside any of them"

    def touches(self, key: str) -> bool:
        if key in self.equal:
            return True
        if len(key) < MIN_OVERLAP_CHARS:
            return False
        return key in self.joined or any(k in key for k in self.long if len(k) <= len(key))
