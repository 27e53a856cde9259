"""The drafter registry: one entry per kind, consistent with what reads it."""

from __future__ import annotations

import pytest

from tests.conftest import make_hf_model
from vllm_moa.drafters.presets import (
    TargetInfo,
    make_config,
    make_eagle3_config,
    make_eagle_config,
    make_griffin_config,
    make_independent_config,
)
from vllm_moa.factories.methods import method_for
from vllm_moa.factories.proposers import make_proposer
from vllm_moa.hf_target import HFTarget
from vllm_moa.kinds import BY_MODEL_TYPE, BY_NAME, KINDS, kind_of
from vllm_moa.training.config import TrainConfig


def test_every_kind_is_trainable_and_named_once():
    choices = TrainConfig.__dataclass_fields__["method"].metadata["choices"]()
    assert set(choices) == set(BY_NAME)  # train --method choices are the registry's kinds
    assert len(BY_MODEL_TYPE) == len(BY_NAME) == len(KINDS)
    for kind in KINDS:
        assert kind.model_type == kind.load("config").MODEL_TYPE


@pytest.mark.parametrize("name", ["moa", "eagle", "griffin", "eagle3", "independent"])
def test_each_kind_builds_its_proposer_and_training_method(name):
    target = HFTarget(make_hf_model())
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    makers = {
        "moa": make_config,
        "eagle": make_eagle_config,
        "griffin": make_griffin_config,
        "eagle3": make_eagle3_config,
        "independent": make_independent_config,
    }
    kind = BY_NAME[name]
    drafter = kind.load("module")(makers[name](info, "small"))
    assert kind_of(drafter) is kind
    assert type(make_proposer(drafter, target)) is kind.load("proposer")
    assert type(method_for(drafter, target)) is kind.load("method")


def test_an_unregistered_module_is_refused_by_name():
    with pytest.raises(TypeError, match="Linear is not a registered drafter kind"):
        kind_of(__import__("torch").nn.Linear(2, 2))
