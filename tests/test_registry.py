"""A new drafter kind is its folder plus one registry entry (vllm_moa/kinds.py): a kind defined
here, registered for the test only, is trained by `train --method`, saved and loaded, drafts
in the standalone engine (greedy output equal to plain decoding) and is split for client-server
decoding, with no other change to the package."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

from vllm_moa import kinds
from vllm_moa.drafters.independent.config import IndependentConfig
from vllm_moa.drafters.independent.model import IndependentDrafter
from vllm_moa.drafters.presets import make_independent_config
from vllm_moa.model.target_info import TargetInfo

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k


@dataclasses.dataclass(frozen=True)
class OneLayerConfig(IndependentConfig):
    MODEL_TYPE: ClassVar[str] = "one_layer_drafter"
    ARCHITECTURE: ClassVar[str] = "OneLayerDrafter"


class OneLayerDrafter(IndependentDrafter):
    """The new kind: an independent drafter of one layer, under its own name and model_type."""


def one_layer_config(target: TargetInfo, preset: str = "paper") -> OneLayerConfig:
    fields = dataclasses.asdict(make_independent_config(target, preset, num_layers=1))
    return OneLayerConfig(**fields)


HERE = __name__
ONE_LAYER = kinds.DrafterKind(
    name="one_layer",
    model_type=OneLayerConfig.MODEL_TYPE,
    config=f"{HERE}:OneLayerConfig",
    module=f"{HERE}:OneLayerDrafter",
    proposer="vllm_moa.drafters.independent.proposer:IndependentProposer",
    method="vllm_moa.drafters.independent.method:IndependentMethod",
    split="vllm_moa.drafters.split:TokensOnly",
    sizing=f"{HERE}:one_layer_config",
)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(kinds, "KINDS", (*kinds.KINDS, ONE_LAYER))
    monkeypatch.setitem(kinds.BY_NAME, ONE_LAYER.name, ONE_LAYER)
    monkeypatch.setitem(kinds.BY_MODEL_TYPE, ONE_LAYER.model_type, ONE_LAYER)


def test_a_new_kind_trains_loads_drafts_and_splits(registered, tiny_target_dir, tmp_path):
    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.cli.main import main
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.factories.proposers import make_proposer
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.remote.split import ServerHalf, client_proposer, split_of

    data = tmp_path / "d.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "run"
    args = ["train", "--target", tiny_target_dir, "--data", str(data), "--out", str(out),
            "--method", "one_layer", "--max-steps", "2", "--batch-size", "2",
            "--max-length", "32", "--eval-examples", "0", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    target = HFTarget.from_pretrained(tiny_target_dir)
    drafter = load_drafter(out / "drafter", target.shape)
    assert type(drafter) is OneLayerDrafter and kinds.kind_of(drafter) is ONE_LAYER
    assert drafter.config.num_layers == 1

    prompt = [5, 17, 33, 2, 9]
    plain = SpeculativeEngine(target).generate(prompt, 16, adaptive=False).token_ids
    engine = SpeculativeEngine(target, make_proposer(drafter, target))
    result = engine.generate(prompt, 16, num_speculative_tokens=3, adaptive=False)
    assert result.token_ids == plain and result.stats.num_draft_tokens > 0

    half = ServerHalf(drafter, target.shape.num_layers)
    assert half.kind == "one_layer" and half.hidden_layers == ()
    assert half.rows(target.forward(torch.tensor(prompt)), torch.arange(len(prompt))) == []
    assert split_of("one_layer").expected_rows(0) == 0
    assert type(client_proposer(drafter, target)).__name__ == "IndependentProposer"


def test_an_unregistered_kind_is_refused(tiny_target_dir, tmp_path):
    """Control: the same command without the registry entry is refused by `train --method`."""
    from vllm_moa.cli.main import main

    with pytest.raises(SystemExit):
        main(["train", "--target", tiny_target_dir, "--data", str(tmp_path), "--out",
              str(tmp_path / "o"), "--method", "one_layer", "--max-steps", "1"])  # fmt: skip
