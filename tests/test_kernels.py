"""Triton kernels vs their PyTorch references: compiled on a CUDA GPU when there is one, else on
the CPU under the Triton interpreter (TRITON_INTERPRET=1, set in conftest).

Tolerances: both sides compute in fp32 and differ only in summation order (online softmax,
blocked dot products), about 1e-6 relative for these sizes; 1e-5 leaves margin without hiding a
wrong mask (which moves outputs by O(1))."""

import pytest
import torch

from tests.deps import need

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

need("triton")

from vllm_moa.kernels.layer_attention import layer_attention, layer_attention_ref  # noqa: E402
from vllm_moa.kernels.paged_layer_kv import paged_layer_kv, paged_layer_kv_ref  # noqa: E402
from vllm_moa.kernels.tree_attention import tree_attention, tree_attention_ref  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in tensors)


@pytest.mark.parametrize(
    "n, h, hkv, layers, d",
    [
        (1, 1, 1, 1, 8),
        (3, 4, 2, 5, 64),
        (1, 6, 3, 7, 24),
        (2, 8, 2, 32, 128),
        (17, 4, 1, 32, 64),
        (2, 12, 2, 32, 64),  # 6 heads per group, one per program (fp32's default tile)
    ],
)
@pytest.mark.parametrize("block_g", [None, 4])  # 4: two programs of 4 heads, the second half-empty
def test_layer_attention_matches_reference(n, h, hkv, layers, d, block_g):
    g = torch.Generator().manual_seed(n * 1000 + layers)
    q = torch.randn(n, h, layers, d, generator=g)
    k = torch.randn(n, hkv, layers, d, generator=g)
    v = torch.randn(n, hkv, layers, d, generator=g)
    q, k, v = _on(q, k, v)
    out = layer_attention(q, k, v, block_g=block_g)
    torch.testing.assert_close(out, layer_attention_ref(q, k, v), **TOL)


def test_layer_attention_equals_the_lsa_block_attention():
    """The kernel computes what the drafter's LSA attention computes (full mask, GQA)."""
    from vllm_moa.model.layers import masked_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = _on(torch.randn(4, 8, 6, 32, generator=g), *torch.randn(2, 4, 2, 6, 32, generator=g))
    torch.testing.assert_close(layer_attention(q, k, v), masked_attention(q, k, v, None), **TOL)


def test_layer_attention_rejects_bad_shapes():
    q = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="multiple of KV heads 2"):
        layer_attention(q, torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8))
    with pytest.raises(ValueError, match="do not match q"):
        layer_attention(q, torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8))


@pytest.mark.parametrize(
    "n, layers, hkv, d, block_size, num_blocks, dtype",
    [
        (1, 1, 1, 16, 16, 1, torch.float32),  # size 1
        (37, 3, 2, 64, 16, 5, torch.bfloat16),  # slots across block boundaries, bf16
        (20, 5, 3, 24, 8, 7, torch.float32),  # non-power-of-two heads and head size
        (48, 32, 8, 128, 16, 40, torch.bfloat16),  # Llama-3-8B's L, Hkv, D (interpreter: 48 tokens)
        (9, 2, 2, 5, 16, 3, torch.bfloat16),  # V views 10 bytes in: no 16-byte alignment hint
    ],
)
def test_paged_layer_kv_matches_reference(n, layers, hkv, d, block_size, num_blocks, dtype):
    """A pure copy: exact equality, no tolerance. Caches in vLLM's channel-split layout
    [num_blocks, Hkv, block_size, 2D] (one allocation per layer), slots in random order."""
    g = torch.Generator().manual_seed(n * 100 + layers)
    shape = (num_blocks, hkv, block_size, 2 * d)
    caches = [torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(layers)]
    keys, values = [c[..., :d] for c in caches], [c[..., d:] for c in caches]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(DEVICE)
    got = paged_layer_kv(keys, values, slots)
    assert got.shape == (n, layers, hkv * 2 * d) and got.dtype == dtype
    assert torch.equal(got, paged_layer_kv_ref(keys, values, slots))
    # per layer [k_h0 | v_h0 | k_h1 | ...], as the drafter's LSA reads it
    blk, off = slots[-1] // block_size, slots[-1] % block_size
    assert torch.equal(got[-1, -1, d : 2 * d], caches[-1][blk, 0, off, d:])


def test_paged_layer_kv_reads_split_kv_layouts():
    """Other layouts through strides: K and V as separate [2, num_blocks, block_size, Hkv, D]
    planes (token-major), as views [num_blocks, Hkv, block_size, D]."""
    g = torch.Generator().manual_seed(3)
    planes = _on(*(torch.randn(2, 6, 16, 4, 32, generator=g) for _ in range(4)))
    keys = [p[0].transpose(1, 2) for p in planes]
    values = [p[1].transpose(1, 2) for p in planes]
    slots = torch.tensor([0, 15, 16, 95, 40], dtype=torch.int32, device=DEVICE)
    assert torch.equal(paged_layer_kv(keys, values, slots), paged_layer_kv_ref(keys, values, slots))


def test_paged_layer_kv_rejects_mismatched_layers():
    caches = [torch.randn(3, 2, 16, 128) for _ in range(2)]
    keys, values = [c[..., :64] for c in caches], [c[..., 64:] for c in caches]
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="one key and one value cache per layer"):
        paged_layer_kv(keys, values[:1], slots)
    with pytest.raises(ValueError, match=r"key cache 1 is .* every layer must match key cache 0"):
        paged_layer_kv([keys[0], keys[1].contiguous()], values, slots)
    with pytest.raises(ValueError, match="slots must be a 1-D integer tensor"):
        paged_layer_kv(keys, values, slots.float())


def test_vllm_gather_uses_the_paged_kernel_when_enabled(monkeypatch):
    """kv_reader.gather_layer_kv (the vLLM proposer's LSA read) launches the kernel once for all
    layers of a channel-split backend when kernels are on, and returns what the per-layer PyTorch
    gather returns."""
    need("vllm")
    import vllm_moa.kernels.paged_layer_kv as kernel_module
    from vllm_moa.vllm_plugin.kv_reader import gather_layer_kv

    calls = []
    real = kernel_module.paged_layer_kv

    def spy(keys, values, slots):
        calls.append(len(keys))
        return real(keys, values, slots)

    monkeypatch.setattr(kernel_module, "paged_layer_kv", spy)
    g = torch.Generator().manual_seed(4)
    caches = list(_on(*(torch.randn(4, 2, 16, 128, generator=g) for _ in range(3))))
    slots = torch.tensor([5, 17, 63, 32], device=DEVICE)
    monkeypatch.setenv("VLLM_MOA_KERNELS", "0")
    want = gather_layer_kv(caches, slots, "FLASH_ATTN")
    assert not calls
    monkeypatch.setenv("VLLM_MOA_KERNELS", "1")
    got = gather_layer_kv(caches, slots, "FLASH_ATTN")
    assert calls == [3] and torch.equal(got, want)


def _random_tree_mask(g, batch, m):
    """Ancestor-or-self masks of random trees (each node's parent precedes it)."""
    mask = torch.zeros(batch, m, m, dtype=torch.bool)
    for b in range(batch):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, m)]
        for i in range(m):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parent[j]
    return mask


@pytest.mark.parametrize(
    "batch, m, h, hkv, d, block_size, max_pages",
    [
        (1, 1, 1, 1, 16, 16, 1),  # size 1
        (2, 5, 4, 2, 64, 16, 3),  # GQA 2, prefix across page boundaries
        (3, 20, 8, 2, 32, 8, 6),  # non-power-of-two tree, small pages
        (2, 33, 4, 1, 64, 16, 4),  # tree larger than one 16-row tile, GQA 4
        (4, 62, 8, 2, 64, 16, 8),  # the paper's m=62 nodes
        (2, 29, 6, 2, 32, 16, 3),  # 3 heads per group: (node, head) rows straddle programs
    ],
)
# the fp32 default (16 rows x 16 keys) and the 16-bit one's rows (64) with 32-key tiles
@pytest.mark.parametrize("tiles", [{}, {"block_m": 64, "block_n": 32}])
def test_tree_attention_matches_reference(batch, m, h, hkv, d, block_size, max_pages, tiles):
    g = torch.Generator().manual_seed(m * 100 + batch)
    num_blocks = batch * max_pages + 3
    q = torch.randn(batch, m, h, d, generator=g)
    k_tree, v_tree = torch.randn(2, batch, m, hkv, d, generator=g)
    mask = _random_tree_mask(g, batch, m)
    num_nodes = torch.randint(1, m + 1, (batch,), generator=g)
    num_nodes[0] = m
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g)
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:max_pages] for _ in range(batch)])
    prefix = torch.randint(0, max_pages * block_size + 1, (batch,), generator=g)
    prefix[-1] = max_pages * block_size  # a full last page
    args = _on(q, k_tree, v_tree, mask, num_nodes, k_cache, v_cache, table, prefix)
    torch.testing.assert_close(tree_attention(*args, **tiles), tree_attention_ref(*args), **TOL)


def test_kernel_tiles_must_be_powers_of_two():
    q = torch.randn(1, 2, 2, 16)
    with pytest.raises(ValueError, match="block_g=3: use a power of two >= 1"):
        layer_attention(q, q, q, block_g=3)
    kv = torch.randn(1, 2, 1, 16)
    cache = torch.randn(1, 16, 1, 16)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    table, lens = torch.tensor([[0]]), torch.tensor([2])
    args = (q, kv, kv, mask, lens, cache, cache, table, lens)
    with pytest.raises(ValueError, match="block_n=8: use a power of two >= 16"):
        tree_attention(*args, block_n=8)


def test_tree_attention_mask_matters():
    """Control: a chain mask and a star mask over the same nodes give different outputs."""
    g = torch.Generator().manual_seed(3)
    q, k_tree, v_tree = _on(
        torch.randn(1, 4, 2, 16, generator=g), *torch.randn(2, 1, 4, 1, 16, generator=g)
    )
    k_cache, v_cache = torch.randn(2, 2, 16, 1, 16, generator=g)
    common = _on(torch.tensor([4]), k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([20]))
    chain, star = _on(
        torch.tril(torch.ones(4, 4, dtype=torch.bool))[None],
        (torch.eye(4, dtype=torch.bool) | (torch.arange(4)[None] == 0))[None],
    )
    a = tree_attention(q, k_tree, v_tree, chain, *common)
    b = tree_attention(q, k_tree, v_tree, star, *common)
    assert torch.equal(a[0, :2], b[0, :2]) and not torch.allclose(a[0, 2:], b[0, 2:])


# 16-bit inputs take the tensor-core path (no upcast; the probabilities rounded to the input
# dtype for P @ V). Rule (benchmarks/kernels_gpu.py's): the kernel's error against an fp32
# reference is at most twice that of the PyTorch reference run in the same dtype (which computes
# in fp32 and rounds only its output); measured ratios 1.0-1.2. Triton's interpreter computes
# bfloat16 tl.dot wrongly (numpy has no bfloat16: errors ~1e10 on a bare 16x16 dot), so on the
# CPU float16 stands for the 16-bit path; a GPU runs both.
HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _within_twice_torch(kernel_out, torch_out, ref32):
    kernel_err = float((kernel_out.float() - ref32).abs().max())
    torch_err = float((torch_out.float() - ref32).abs().max())
    assert kernel_err <= 2 * torch_err, (kernel_err, torch_err)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("n, h, hkv, layers, d", [(3, 8, 2, 32, 64), (2, 12, 2, 7, 48)])
def test_layer_attention_16bit(dtype, n, h, hkv, layers, d):
    g = torch.Generator().manual_seed(layers)
    q = torch.randn(n, h, layers, d, generator=g)
    k, v = torch.randn(2, n, hkv, layers, d, generator=g)
    q, k, v = _on(q.to(dtype), k.to(dtype), v.to(dtype))
    ref32 = layer_attention_ref(q.float(), k.float(), v.float())
    _within_twice_torch(layer_attention(q, k, v), layer_attention_ref(q, k, v), ref32)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_tree_attention_16bit(dtype):
    g = torch.Generator().manual_seed(5)
    batch, m, h, hkv, d, block_size, max_pages = 2, 62, 8, 2, 128, 16, 9
    q = torch.randn(batch, m, h, d, generator=g).to(dtype)
    k_tree, v_tree = torch.randn(2, batch, m, hkv, d, generator=g).to(dtype)
    k_cache, v_cache = torch.randn(2, batch * max_pages, block_size, hkv, d, generator=g).to(dtype)
    table = torch.randperm(batch * max_pages, generator=g).view(batch, max_pages)
    args = _on(
        q,
        k_tree,
        v_tree,
        _random_tree_mask(g, batch, m),
        torch.tensor([m, 40]),
        k_cache,
        v_cache,
        table,
        torch.tensor([max_pages * block_size, 77]),
    )
    ref32 = tree_attention_ref(*(a.float() if a.is_floating_point() else a for a in args))
    _within_twice_torch(tree_attention(*args), tree_attention_ref(*args), ref32)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU, run the script itself")
def test_gpu_benchmark_script_smoke(tmp_path):
    """The H200 script itself runs (tiny shapes, CPU interpreter, no timing)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_gpu.py"
    out = tmp_path / "k.json"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert all(
        r["ok"]
        for key in ("layer_attention", "tree_attention", "paged_layer_kv")
        for r in report[key]
    )
    sweep = [
        p for key in ("layer_attention", "tree_attention") for p in report[key][0]["tile_sweep"]
    ]
    from benchmarks.kernels_gpu import LAYER_TILES, TREE_TILES

    assert len(sweep) == len(LAYER_TILES) + len(TREE_TILES), sweep
    assert all(p.get("ok") for p in sweep), sweep


def test_drafter_lsa_uses_the_kernel_when_enabled(llama_target, monkeypatch):
    """With VLLM_MOA_KERNELS=1 (here under the interpreter; `auto` picks it on CUDA), the LSA's
    layer-axis attention runs the Triton kernel when drafting and gives the memory the PyTorch
    path gives; training (gradients on) keeps the differentiable path."""
    from conftest import make_drafter

    import vllm_moa.kernels.layer_attention as kernel_module

    calls = []
    real = kernel_module.layer_attention

    def spy(q, k, v):
        calls.append(q.shape)
        return real(q, k, v)

    monkeypatch.setattr(kernel_module, "layer_attention", spy)
    drafter = make_drafter(llama_target).to(DEVICE)
    shape = llama_target.shape
    torch.manual_seed(1)
    features = torch.randn(5, shape.num_layers, 2 * shape.num_kv_heads * shape.head_dim)
    features = features.to(DEVICE)
    with torch.no_grad():
        monkeypatch.setenv("VLLM_MOA_KERNELS", "0")
        want = drafter.encode_memory(features)
        assert not calls
        monkeypatch.setenv("VLLM_MOA_KERNELS", "1")
        got = drafter.encode_memory(features)
    assert len(calls) == 1 and calls[0][0] == 5 and calls[0][2] == shape.num_layers
    torch.testing.assert_close(got, want, **TOL)
    drafter.encode_memory(features.requires_grad_()).sum().backward()  # grad on: no kernel
    assert len(calls) == 1


def test_kernel_switch_rejects_unknown_values(monkeypatch):
    from vllm_moa.model.layers import use_kernels

    monkeypatch.setenv("VLLM_MOA_KERNELS", "auto")
    assert not use_kernels(torch.device("cpu"))  # auto: CUDA only
    monkeypatch.setenv("VLLM_MOA_KERNELS", "maybe")
    with pytest.raises(ValueError, match="VLLM_MOA_KERNELS='maybe': use auto, 1 or 0"):
        use_kernels(torch.device("cpu"))


def _tree_target():
    from conftest import make_hf_model

    from vllm_moa.hf_target import HFTarget

    target = HFTarget(make_hf_model(vocab_size=12, seed=11).to(DEVICE))
    target.config._attn_implementation = "sdpa"  # what HFTarget.from_pretrained loads
    return target


def test_forward_tree_through_the_kernel_equals_sdpa(monkeypatch):
    """With kernels enabled, every target layer's tree verification runs our Triton kernel
    (spied) and gives the logits and cache contents of the SDPA path."""
    import vllm_moa.kernels.tree_attention as kernel_module

    calls = []
    real = kernel_module.tree_attention
    monkeypatch.setattr(kernel_module, "tree_attention", lambda *a: calls.append(1) or real(*a))
    target = _tree_target()
    # root 6 at position 5; nodes 7 (root's child), 9 (its sibling), 8 (child of 7), 2 (of 9)
    ids, positions = torch.tensor([6, 7, 9, 8, 2]), torch.tensor([5, 6, 6, 7, 7])
    allowed = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
        dtype=torch.bool,
    )
    outs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("VLLM_MOA_KERNELS", mode)
        target.reset()
        target.forward(torch.tensor([1, 4, 3, 11, 5]))
        outs[mode] = target.forward_tree(ids, positions, allowed)
        assert target.config._attn_implementation == "sdpa"  # restored
    assert len(calls) == target.shape.num_layers
    torch.testing.assert_close(outs["1"].logits, outs["0"].logits, **TOL)
    torch.testing.assert_close(outs["1"].layer_kv, outs["0"].layer_kv, **TOL)


def test_tree_decoding_with_kernels_equals_plain_greedy(monkeypatch):
    from conftest import make_drafter

    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.decoding.tree import TreeParams
    from vllm_moa.drafters.moa.proposer import MoAProposer

    target = _tree_target()
    plain = SpeculativeEngine(target).generate([1, 5, 3, 7], 16).token_ids
    monkeypatch.setenv("VLLM_MOA_KERNELS", "1")
    engine = SpeculativeEngine(target, MoAProposer(make_drafter(target).to(DEVICE), target))
    assert engine.generate([1, 5, 3, 7], 16, tree=TreeParams(3, 2, 5)).token_ids == plain
