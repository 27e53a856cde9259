"""`vllm-moa regenerate`: the target's own responses to prompt files, as `train --data` records
(argument parsing lives in main.py; the work in vllm_moa/training/regenerate.py)."""

from __future__ import annotations

import argparse
import dataclasses
import functools

from vllm_moa.training.regenerate_config import RegenerateConfig


def config_from_args(args: argparse.Namespace) -> RegenerateConfig:
    """The flags, one per field (main.py builds them from the dataclass)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RegenerateConfig)}
    values["prompts"] = tuple(args.prompts)
    return RegenerateConfig(**values)


def regenerate(args: argparse.Namespace) -> int:
    from vllm_moa.training.regenerate import regenerate as run
    from vllm_moa.vllm_plugin.offline_generation import VllmGenerator

    config = config_from_args(args)
    summary = run(config, functools.partial(VllmGenerator, config))
    print(summary.describe(config))
    return 0
