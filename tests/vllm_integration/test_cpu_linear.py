"""The drafter's linear layers through vLLM's CPU GEMM dispatch compute what nn.Linear does."""

from __future__ import annotations

import copy

import pytest
import torch

from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.model.config import TargetShape
from vllm_moa.vllm_plugin.cpu_linear import DispatchedLinear, dispatch_linears

pytestmark = pytest.mark.vllm


@torch.inference_mode()
def test_dispatched_drafter_matches_torch_linear():
    torch.manual_seed(0)
    info = TargetInfo(TargetShape(3, 256, 2, 64, 512), num_attention_heads=4)
    drafter = MoADrafter(make_config(info, preset="small", tli=1)).eval()
    drafter.init_weights(seed=0)
    fast = copy.deepcopy(drafter)
    assert dispatch_linears(fast) == sum(isinstance(m, torch.nn.Linear) for m in drafter.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert any(isinstance(m, DispatchedLinear) for m in fast.modules())
    assert fast.state_dict().keys() == drafter.state_dict().keys()
    embeds = torch.randn(2, 9, 256)
    features = torch.randn(2, 9, 3, 256)  # K|V of 3 layers: 2 x 2 KV heads x 64
    limit = torch.arange(9)
    # Same math through another kernel: fp32 rounding (values of order 1).
    torch.testing.assert_close(
        fast(embeds, features, limit), drafter(embeds, features, limit), atol=1e-4, rtol=1e-4
    )
