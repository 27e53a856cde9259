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


@pytest.mark.parametrize("cpu", ["this", "without_bf16"])
def test_bf16_layers_run_on_any_x86_cpu(cpu, monkeypatch):
    """bf16 weights: oneDNN's bf16 kernels where this CPU has them (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT), else packed in fp32 with the inputs cast; either way fp32 products rounded
    to bf16 once. "this": whatever this CPU's probe says; "without_bf16": a CPU without them
    (the same as "this" on such a CPU, a stand-in elsewhere)."""
    from vllm_moa.model import packed_linear

    packed_linear.packed_dtype.cache_clear()
    if cpu == "without_bf16":
        monkeypatch.setattr(
            packed_linear, "_onednn_runs", _without_bf16(packed_linear._onednn_runs)
        )
    try:
        dtype = packed_linear.packed_dtype(torch.bfloat16)
        assert (
            dtype == torch.float32
            if cpu == "without_bf16"
            else dtype in (torch.bfloat16, torch.float32)
        )
        torch.manual_seed(0)
        linear = nn.Linear(96, 80).to(torch.bfloat16)
        x = torch.randn(3, 96).to(torch.bfloat16)
        with torch.no_grad():
            got = PackedLinear(linear)(x)
            want = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        assert got.dtype == torch.bfloat16 and got.shape == (3, 80)
        # one rounding to bf16 (8 significant bits) after another fp32 summation order
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-7)
    finally:
        packed_linear.packed_dtype.cache_clear()


def _without_bf16(probe):
    return lambda dtype: dtype != torch.bfloat16 and probe(dtype)


def test_the_fallback_is_logged_once(monkeypatch, caplog):
    from vllm_moa.model import packed_linear

    packed_linear.packed_dtype.cache_clear()
    monkeypatch.setattr(packed_linear, "_onednn_runs", _without_bf16(packed_linear._onednn_runs))
    try:
        for _ in range(3):
            PackedLinear(nn.Linear(8, 8).to(torch.bfloat16))
        assert caplog.text.count("no bf16 path") == 1
    finally:
        packed_linear.packed_dtype.cache_clear()
