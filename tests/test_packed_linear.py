"""oneDNN linear layers on prepacked weights (CPU inference): the same outputs as nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_moa.model.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=bias)
    x = torch.randn(2, rows, 96)
    with torch.no_grad():
        want = linear(x)
        got = PackedLinear(linear)(x)
    # fp32 on both sides, another summation order over 96 products: rounding only
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gradients_take_the_original_weight():
    linear = nn.Linear(16, 8)
    packed = PackedLinear(linear)
    x = torch.randn(3, 16, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None


def test_pack_linears_replaces_every_linear_and_can_be_turned_off(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    monkeypatch.setenv("VLLM_MOA_CPU_GEMM", "0")
    assert pack_linears(nn.Sequential(nn.Linear(8, 8))) == 0
