"""The drafter kinds, registered once, on the ground floor. Each kind is one folder with the same
files: vllm_moa/drafters/KIND/config.py (its config), model.py (its module), proposer.py (its
standalone proposer, trees included) and method.py (its training method); token_layers.py holds
what the two baselines share. This table names each kind's classes. Checkpoint loading and
validation, the proposer and training factories, the client-server split (drafters/split.py),
`train --method` and the vLLM plugin all read it. Classes are named by import path and loaded
on first use, so this module imports no other part of the package and any of them can read it
without an import cycle (as vLLM's model registry does).

Adding a kind: its folder (config, model, proposer, method, and its client-server split), then
one `DrafterKind` below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DrafterKind:
    name: str  # `train --method`, the client-server split, stats
    model_type: str  # config.json's model_type
    config: str  # "module:Class" of each part
    module: str
    proposer: str  # Proposer(drafter, target)
    method: str  # training: Method(drafter, target, feature_noise=...)
    split: str  # client-server: what the server sends (drafters/split.py's `Split`)
    sizing: str  # drafters/presets.py's function: Config(target_info, preset, **options)
    options: tuple[str, ...] = ()  # `train` options the sizing takes beyond the preset
    label: str = ""  # how messages name the kind (default: its name)
    # Token-aligned training the kind's recipe does where `train` is given none: (passes, top-k
    # of their mask, 0 = none; per-pass loss decay), TrainConfig.alignment. None: off.
    alignment: tuple[int, int, float] | None = None

    def load(self, part: str) -> Any:
        """The object one of the kind's parts names ("config", "module", "proposer", "method",
        "split" or "sizing"), imported on first use."""
        module, _, name = getattr(self, part).partition(":")
        return getattr(importlib.import_module(module), name)


KINDS: tuple[DrafterKind, ...] = (
    DrafterKind(
        name="moa",
        model_type="moa_drafter",
        config="vllm_moa.drafters.moa.config:MoAConfig",
        module="vllm_moa.drafters.moa.model:MoADrafter",
        proposer="vllm_moa.drafters.moa.proposer:MoAProposer",
        method="vllm_moa.drafters.moa.method:MoAMethod",
        split="vllm_moa.drafters.moa.split:MoASplit",
        sizing="vllm_moa.drafters.presets:make_config",
        options=("tli", "memory_source", "draft_vocab"),
        label="MoA",
    ),
    DrafterKind(
        name="eagle",
        model_type="eagle_drafter",
        config="vllm_moa.drafters.eagle.config:EagleConfig",
        module="vllm_moa.drafters.eagle.model:EagleDrafter",
        proposer="vllm_moa.drafters.eagle.proposer:EagleProposer",
        method="vllm_moa.drafters.eagle.method:EagleMethod",
        split="vllm_moa.drafters.split:FinalFeature",
        sizing="vllm_moa.drafters.presets:make_eagle_config",
        label="EAGLE",
    ),
    DrafterKind(
        name="griffin",
        model_type="griffin_drafter",
        config="vllm_moa.drafters.griffin.config:GriffinConfig",
        module="vllm_moa.drafters.griffin.model:GriffinDrafter",
        proposer="vllm_moa.drafters.griffin.proposer:GriffinProposer",
        method="vllm_moa.drafters.griffin.method:GriffinMethod",
        split="vllm_moa.drafters.split:FinalFeature",
        sizing="vllm_moa.drafters.presets:make_griffin_config",
        label="GRIFFIN",
    ),
    DrafterKind(
        name="eagle3",
        model_type="eagle3_drafter",
        config="vllm_moa.drafters.eagle3.config:Eagle3Config",
        module="vllm_moa.drafters.eagle3.model:Eagle3Drafter",
        proposer="vllm_moa.drafters.eagle3.proposer:Eagle3Proposer",
        method="vllm_moa.drafters.eagle3.method:Eagle3Method",
        split="vllm_moa.drafters.eagle3.split:Eagle3Split",
        sizing="vllm_moa.drafters.presets:make_eagle3_config",
        options=("draft_vocab",),
        label="EAGLE-3",
        alignment=(7, 0, 0.8),  # the training-time test: 7 steps, unmasked, weights 0.8^n
    ),
    DrafterKind(
        name="independent",
        model_type="independent_drafter",
        config="vllm_moa.drafters.independent.config:IndependentConfig",
        module="vllm_moa.drafters.independent.model:IndependentDrafter",
        proposer="vllm_moa.drafters.independent.proposer:IndependentProposer",
        method="vllm_moa.drafters.independent.method:IndependentMethod",
        split="vllm_moa.drafters.split:TokensOnly",
        sizing="vllm_moa.drafters.presets:make_independent_config",
    ),
)
BY_MODEL_TYPE = {k.model_type: k for k in KINDS}
BY_NAME = {k.name: k for k in KINDS}


def kind_names() -> tuple[str, ...]:
    """The registered kinds' names (`train --method`'s choices)."""
    return tuple(BY_NAME)


def kind_of(drafter: object) -> DrafterKind:
    """The registered kind of a drafter module (TypeError for anything else): the kind whose
    class it is, else the first whose class it derives from (GRIFFIN's drafter is an EAGLE
    drafter, but of its own kind)."""
    for kind in KINDS:
        if type(drafter) is kind.load("module"):
            return kind
    for kind in KINDS:
        if isinstance(drafter, kind.load("module")):
            return kind
    raise TypeError(f"{type(drafter).__name__} is not a registered drafter kind")
