"""Proposers from what the user names: a loaded drafter of any kind (the registry names it), or
a hierarchy level (`ngram` or a drafter directory, as `generate --hierarchy` lists them)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vllm_moa.decoding.proposer import LevelProposer, Proposer
from vllm_moa.hf_target.adapter import SUPPORTED_MODEL_TYPES, HFTarget
from vllm_moa.kinds import kind_of
from vllm_moa.model.packed_linear import pack_linears

NGRAM = "ngram"  # prompt lookup (decoding/ngram_proposer.py): no model


def make_proposer(drafter: nn.Module, target: HFTarget) -> Proposer:
    """The drafter's proposer, for inference with its weights as they are: on the CPU its
    linear layers run oneDNN on prepacked copies of their weights (model/packed_linear.py), so
    train no further the drafter handed here."""
    pack_linears(drafter)
    proposer: Proposer = kind_of(drafter).load("proposer")(drafter, target)
    return proposer


def parse_levels(text: str) -> list[str]:
    """LEVELS: the levels below the target, bottom first, comma-separated."""
    entries = [e.strip() for e in text.split(",")]
    if not text.strip() or any(not e for e in entries):
        raise ValueError(
            f"LEVELS {text!r} has an empty entry: list the levels below the target bottom first, "
            f"comma-separated, each `{NGRAM}` or a drafter directory (e.g. {NGRAM},DRAFTER_DIR)"
        )
    return entries


def level_proposer(
    entry: str,
    target: HFTarget,
    target_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> LevelProposer:
    """The proposer of one LEVELS entry, checked: prompt lookup, or a drafter made for `target`
    (not the target itself, nor another model)."""
    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.checkpoint.io import CONFIG_NAME, drafter_dir_of
    from vllm_moa.decoding.ngram_proposer import NgramProposer
    from vllm_moa.model.config import read_config_json

    if entry == NGRAM:
        return NgramProposer(target.shape.vocab_size)
    path = drafter_dir_of(entry)
    if not path.is_dir():
        raise FileNotFoundError(
            f"LEVELS entry {entry!r} is neither `{NGRAM}` nor an existing drafter directory: give "
            "prompt lookup as `ngram` or the path of a drafter made for this target"
        )
    same = target_dir is not None and path.resolve() == Path(target_dir).resolve()
    model_type = read_config_json(path / CONFIG_NAME).get("model_type")
    if same or model_type in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"LEVELS entry {entry!r} is {'the target itself' if same else 'a language model'} "
            f"(model_type {model_type!r}): list only the drafters below the target; the target "
            "always verifies last"
        )
    try:
        drafter = load_drafter(path, target=target.shape, dtype=dtype, device=device)
    except ValueError as e:
        raise ValueError(f"LEVELS entry {entry!r}: {e}") from None
    proposer = make_proposer(drafter, target)
    assert isinstance(proposer, LevelProposer)  # every registered kind drafts after pending
    return proposer
