import pytest
import torch

from vllm_moa.model.layers import masked_attention, reference_attention
from vllm_moa.model.masks import bounded_memory_limits, causal_mask, memory_mask

T, F = True, False


def test_causal_mask_with_offset():
    # Two new queries at positions 3 and 4 over 5 keys.
    expected = torch.tensor([[T, T, T, T, F], [T, T, T, T, T]])
    assert torch.equal(causal_mask(torch.tensor([3, 4]), 5), expected)


def test_memory_mask():
    expected = torch.tensor([[F, F, F, F], [T, T, F, F], [T, T, F, F], [T, T, T, T]])
    assert torch.equal(memory_mask(torch.tensor([0, 2, 2, 4]), 4), expected)


def test_bounded_memory_limits_cycles():
    # prompt of 3, cycles of 2: positions 3,4 see rows < 3; 5,6 see < 5; 7 sees < 7.
    limits = bounded_memory_limits(seq_len=8, prompt_len=3, refresh_every=2)
    assert limits.tolist() == [0, 1, 2, 3, 3, 5, 5, 7]
    expected = torch.tensor(
        [
            [F, F, F, F, F, F, F, F],
            [T, F, F, F, F, F, F, F],
            [T, T, F, F, F, F, F, F],
            [T, T, T, F, F, F, F, F],
            [T, T, T, F, F, F, F, F],
            [T, T, T, T, T, F, F, F],
            [T, T, T, T, T, F, F, F],
            [T, T, T, T, T, T, T, F],
        ]
    )
    assert torch.equal(memory_mask(limits, 8), expected)
    # No query ever sees its own row (the target has not run its token yet).
    assert not memory_mask(limits, 8).diagonal().any()


def test_masked_attention_matches_sdpa_with_gqa():
    g = torch.Generator().manual_seed(0)
    for b, h, hkv, t, s, d in [(1, 1, 1, 1, 1, 8), (2, 4, 2, 5, 7, 16), (3, 6, 1, 9, 9, 32)]:
        q = torch.randn(b, h, t, d, generator=g)
        k = torch.randn(b, hkv, s, d, generator=g)
        v = torch.randn(b, hkv, s, d, generator=g)
        mask = torch.rand(t, s, generator=g) < 0.7
        mask[:, 0] = True  # every row sees something, as SDPA needs
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), attn_mask=mask
        )
        # fp32 throughout: differences are summation order only (~1e-7 relative).
        torch.testing.assert_close(masked_attention(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)


def test_masked_attention_empty_rows_are_zero_and_have_finite_grads():
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k = torch.randn(1, 1, 4, 8, requires_grad=True)
    v = torch.randn(1, 1, 4, 8, requires_grad=True)
    mask = torch.tensor([[F, F, F, F], [T, F, F, F], [T, T, T, T]])
    out = masked_attention(q, k, v, mask)
    assert torch.equal(out[0, :, 0], torch.zeros(2, 8))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_inference_path_matches_reference(dtype):
    """Without gradients masked_attention takes PyTorch's fused SDPA; it must agree with the fp32
    reference, fully masked rows (zeros), per-row masks [B, 1, T, S] and GQA included."""
    g = torch.Generator().manual_seed(1)
    for b, h, hkv, t, s, d in [(1, 1, 1, 1, 1, 8), (4, 4, 2, 1, 37, 64), (3, 6, 1, 9, 9, 32)]:
        q, k, v = (torch.randn(b, n, x, d, generator=g).to(dtype)
                   for n, x in ((h, t), (hkv, s), (hkv, s)))  # fmt: skip
        mask = torch.rand(b, 1, t, s, generator=g) < 0.6
        mask[0, 0, 0] = False  # a row with no visible key
        ref = reference_attention(q, k, v, mask)
        with torch.no_grad():
            fast = masked_attention(q, k, v, mask)
            unmasked = masked_attention(q, k, v, None)
        assert torch.equal(fast[0, :, 0], torch.zeros_like(fast[0, :, 0]))
        # fp32: summation order only. bf16: the reference rounds probabilities to bf16 before
        # the PV product, SDPA keeps them in fp32: a few bf16 ulps (2^-8 relative) apart.
        tol = (
            {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        )
        torch.testing.assert_close(fast, ref, **tol)
        torch.testing.assert_close(unmasked, reference_attention(q, k, v, None), **tol)
