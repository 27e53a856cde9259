"""The vLLM proposer's draft step is ready for CUDA graphs: no host sync, no data-dependent shape.

Proved on the CPU with torch.compile(fullgraph=True), which fails on any graph break (a sync such
as .item() or .tolist(), a shape that depends on data, an untraceable call). The paged stores are
the PyTorch reference (`TorchPagedKV`, what GPU backends run today), so no vLLM is needed; with
vLLM's CPU ops the step is one graph too (tests/vllm_integration/test_compiled_proposer.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.model.config import TargetShape
from vllm_moa.vllm_plugin.drafting import paged_draft_step
from vllm_moa.vllm_plugin.paged_attention import TorchPagedKV, page_views

# Llama-3.1's RoPE scaling: SA reads its frequencies from a buffer (model/rope.py).
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _setup(rope_scaling: dict | None = None):
    torch.manual_seed(0)
    info = TargetInfo(TargetShape(3, 128, 1, 64, 256, rope_scaling), num_attention_heads=2)
    drafter = MoADrafter(make_config(info, preset="small")).eval()
    drafter.init_weights(seed=0)
    embed = nn.Embedding(256, 128)
    blocks, block_size = 9, 16
    sa, ca = drafter.self_attention.self_attn, drafter.cross_attention.self_attn
    stores = {}
    for name, attn in (("sa", sa), ("memory", ca)):
        cache = torch.randn(blocks, 1, block_size, 128)  # a page layer shaped like the target's
        stores[name] = TorchPagedKV(*page_views(cache, attn.num_kv_heads, attn.head_dim))
    table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 0]], dtype=torch.int32)
    args = dict(
        tokens=torch.tensor([5, 17, 200]),
        positions=torch.tensor([0, 20, 40]),
        ends=torch.tensor([4, 24, 42]),  # the last row's budget ends within this cycle
        memory_lens=torch.tensor([1, 20, 40], dtype=torch.int32),
        has_memory=torch.tensor([0, 1, 1])[:, None, None],
    )
    return drafter, embed, stores, table, block_size, args


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3], ids=["plain", "llama3"])
@torch.inference_mode()
def test_draft_loop_compiles_without_graph_breaks(rope_scaling):
    drafter, embed, stores, table, block_size, args = _setup(rope_scaling)
    assert drafter.config.sa_rope_scaling == rope_scaling
    eager_stores = {n: TorchPagedKV(s.key.clone(), s.value.clone()) for n, s in stores.items()}

    def loop(stores, tokens, positions, ends, memory_lens, has_memory):
        drafted = []
        for _ in range(3):  # a chain of three drafts, as the proposer runs it
            h = paged_draft_step(
                drafter, stores, table, block_size, embed(tokens), positions, ends,
                memory_lens, has_memory,
            )  # fmt: skip
            tokens = (h @ embed.weight.T).argmax(dim=-1)  # a stand-in LM head
            drafted.append(tokens)
            positions = positions + 1
        return torch.stack(drafted, dim=1)

    torch._dynamo.reset()
    compiled = torch.compile(loop, fullgraph=True, backend="eager")
    got = compiled(stores, **args)
    want = loop(eager_stores, **args)
    assert torch.equal(got, want)
    # The rows' SA K/V were written through the compiled graph too (the last row only at its
    # two budgeted positions: 40, 41; 42 has no slot and block 0 takes nothing of it but junk).
    torch.testing.assert_close(stores["sa"].key[1:], eager_stores["sa"].key[1:])
