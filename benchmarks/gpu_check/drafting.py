"""Step 3a: MoA's paged draft step as the vLLM integration runs it, without vLLM, next to one
target decoder layer: the draft / target cost ratio c.

The drafter (`paper` preset, random weights) drafts over page stores laid out as vLLM's
FLASH_ATTN caches ([num_blocks, num_kv_heads, block_size, 2 * head_size], one per page layer,
built by hand; `page_views` as in serving), every request's blocks scattered over the pages.
One draft step is what `MoADraftCore.draft` runs per token at TLI 0: the target's embedding,
`paged_draft_step` (SA writing its own K/V, then SA and CA over the pages), the target's LM head
and the argmax. Timed with `TritonPagedKV` (the paged Triton kernel, what GPU pages serve with)
and `TorchPagedKV` (the PyTorch reference), eager and replayed from a CUDA graph (equal outputs
checked), at batch 1 / 8 / 32 and context 512 / 4096. The target's cost: one Llama-3-8B
`LlamaDecoderLayer` (transformers, random bf16 weights) decoding one token per request over a
KV cache of the same context, times 32 layers, plus the LM head. c = draft step / target step.
`page_rows` (the memory and SA rows of verified tokens, through LSA) is timed per verified
token with the layer-attention kernel and with PyTorch. The LM head is also timed over a draft
vocabulary of 32000 rows (MoA's `--draft-vocab`, EAGLE-3's size), and c recomputed with it in
place of the full head (`c_draft_vocab_*`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from benchmarks.gpu_check.common import StepContext, guarded, timer
from benchmarks.gpu_check.plan import peak_bandwidth
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.model.config import TargetShape
from vllm_moa.vllm_plugin.drafting import page_rows, paged_draft_step
from vllm_moa.vllm_plugin.paged_attention import PagedKV, TorchPagedKV, TritonPagedKV, page_views

LLAMA3_8B = TargetShape(32, 4096, 8, 128, 128256)  # 32 heads, MLP 14336, rope theta 5e5
TINY = TargetShape(4, 128, 1, 64, 512)  # the CPU mode's (benchmarks/cost_model.py SMOKE)
BLOCK_SIZE = 16
DRAFT_VOCAB = 32000  # the published EAGLE-3 drafters' (`vllm-moa train --draft-vocab 32000`)
SPARE = 4  # positions past the context each request may still draft into (its budget)

Step = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Sizes:
    shape: TargetShape
    heads: int
    intermediate: int
    rope_theta: float
    batches: tuple[int, ...]
    contexts: tuple[int, ...]


def sizes(cpu: bool) -> Sizes:
    if cpu:
        return Sizes(TINY, 2, 256, 10000.0, (1, 2), (16, 40))
    return Sizes(LLAMA3_8B, 32, 14336, 500000.0, (1, 8, 32), (512, 4096))


@dataclass
class Bench:
    """The drafter, the target's embedding and LM head, and the two page layers (one dense
    cache each, shaped like a target layer's) every configuration draws its blocks from."""

    sizes: Sizes
    drafter: MoADrafter
    embed: nn.Embedding
    head: nn.Linear
    caches: dict[str, torch.Tensor]  # "sa", "memory": [num_blocks, Hkv, block_size, 2 * D]
    device: str

    def stores(self, kind: type[TorchPagedKV]) -> dict[str, PagedKV]:
        sa, ca = self.drafter.self_attention.self_attn, self.drafter.cross_attention.self_attn
        return {
            "sa": kind(*page_views(self.caches["sa"], sa.num_kv_heads, sa.head_dim)),
            "memory": kind(*page_views(self.caches["memory"], ca.num_kv_heads, ca.head_dim)),
        }

    def inputs(self, batch: int, context: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """Requests of `context` verified tokens each (their SA and memory rows in the pages),
        drafting the token at position `context`; blocks scattered over the pages."""
        per_row = math.ceil((context + SPARE + 1) / BLOCK_SIZE)
        g = torch.Generator().manual_seed(seed)
        blocks = torch.randperm(self.caches["sa"].shape[0] - 1, generator=g)[: batch * per_row]
        positions = torch.full((batch,), context)
        tensors = {
            "table": (blocks + 1).view(batch, per_row).to(torch.int32),  # block 0: vLLM's null
            "tokens": torch.randint(0, self.sizes.shape.vocab_size, (batch,), generator=g),
            "positions": positions,
            "ends": positions + SPARE,
            "memory_lens": positions.to(torch.int32),
            "has_memory": torch.ones(batch, 1, 1, dtype=torch.long),
        }
        return {k: v.to(self.device) for k, v in tensors.items()}

    def step(self, stores: dict[str, PagedKV], x: dict[str, torch.Tensor], fn: Step) -> Any:
        """One draft step (TLI 0): (the step's output [B, E], the drafted tokens [B])."""
        h = fn(
            self.drafter, stores, x["table"], BLOCK_SIZE, self.embed(x["tokens"]),
            x["positions"], x["ends"], x["memory_lens"], x["has_memory"],
        )  # fmt: skip
        return h, self.head(h.to(self.head.weight.dtype)).argmax(dim=-1)


def build(ctx: StepContext) -> Bench:
    s = sizes(ctx.cpu)
    torch.manual_seed(0)
    info = TargetInfo(s.shape, s.heads, rope_theta=s.rope_theta)
    drafter = MoADrafter(make_config(info, "paper"))
    drafter.init_weights(0)
    drafter.to(device=ctx.device, dtype=ctx.dtype).eval()
    with torch.device(ctx.device):
        embed = nn.Embedding(s.shape.vocab_size, s.shape.hidden_size, dtype=ctx.dtype)
        head = nn.Linear(s.shape.hidden_size, s.shape.vocab_size, bias=False, dtype=ctx.dtype)
        nn.init.normal_(head.weight, std=0.02)
        blocks = 1 + max(s.batches) * math.ceil((max(s.contexts) + SPARE + 1) / BLOCK_SIZE)
        layer = (blocks, s.shape.num_kv_heads, BLOCK_SIZE, 2 * s.shape.head_dim)
        caches = {n: torch.randn(layer, dtype=ctx.dtype) for n in ("sa", "memory")}
    return Bench(s, drafter, embed.eval(), head.eval(), caches, ctx.device)


class StaticKV:
    """A decoder layer's K/V cache of `context` earlier tokens plus the one decoded [B, Hkv,
    context + 1, D]: what HF attention's `past_key_values.update` returns (no growth: a CUDA
    graph can replay the step)."""

    def __init__(self, batch: int, context: int, s: Sizes, device: str, dtype: torch.dtype):
        shape = (batch, s.shape.num_kv_heads, context + 1, s.shape.head_dim)
        self.key = torch.randn(shape, device=device, dtype=dtype)
        self.value = torch.randn(shape, device=device, dtype=dtype)
        self.context = context

    def update(self, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any) -> Any:
        self.key[:, :, self.context :] = key
        self.value[:, :, self.context :] = value
        return self.key, self.value


def target_layer(s: Sizes, device: str, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """One Llama decoder layer of the target and its rotary embedding (random weights)."""
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config: Any = tf.LlamaConfig(  # type: ignore[call-arg]
        vocab_size=s.shape.vocab_size,
        hidden_size=s.shape.hidden_size,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.shape.num_layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.shape.num_kv_heads,
        head_dim=s.shape.head_dim,
        max_position_embeddings=8192,
        rope_theta=s.rope_theta,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype).eval()
        rotary = LlamaRotaryEmbedding(config)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.ones_(p)
    return layer, rotary


def graphed(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn captured in a CUDA graph (after warm-up runs on a side stream) and its static
    outputs, which each replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (a device sync)."""
    return float(
        (got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)
    )


def draft_bytes(bench: Bench, batch: int, context: int) -> int:
    """What one draft step must read at least: SA + CA weights, the LM head, each request's
    SA and memory K/V rows."""
    d = bench.drafter
    weights = sum(
        p.numel() * p.element_size()
        for m in (d.self_attention, d.cross_attention, bench.head)
        for p in m.parameters()
    )
    sa, ca = d.self_attention.self_attn, d.cross_attention.self_attn
    elem = bench.caches["sa"].element_size()
    rows = (
        batch * (context + 1) * 2 * (sa.num_kv_heads * sa.head_dim + ca.num_kv_heads * ca.head_dim)
    )
    return weights + rows * elem


def time_draft(ctx: StepContext, bench: Bench, batch: int, context: int) -> dict[str, Any]:
    """One configuration: Triton and PyTorch pages, eager and graph-replayed; their outputs."""
    part, time_ms = ctx.part, timer(ctx.device)
    tol = 1e-4 if ctx.cpu else 3e-2  # bf16: two attention paths round differently (~2^-8)
    x = bench.inputs(batch, context)
    row: dict[str, Any] = {"batch": batch, "context": context}
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for name, kind in (("triton", TritonPagedKV), ("torch", TorchPagedKV)):
            stores = bench.stores(kind)

            def run(stores: dict[str, PagedKV] = stores) -> Any:
                return bench.step(stores, x, paged_draft_step)

            out[name] = run()
            row[f"{name}_eager_ms"] = time_ms(run)
            if ctx.cpu:
                continue
            captured = guarded(part, f"{name}_graph_b{batch}_c{context}", partial(graphed, run))
            if captured is not None:
                graph, static = captured
                graph.replay()
                same = torch.equal(static[0], out[name][0]) and torch.equal(static[1], out[name][1])
                row[f"{name}_graph_equals_eager"] = part.check(
                    f"graph_equals_eager_{name}_b{batch}_c{context}", same
                )
                row[f"{name}_graph_ms"] = time_ms(graph.replay)
    err = relative_error(out["triton"][0], out["torch"][0])
    row["triton_vs_torch_relative_error"] = err
    row["triton_vs_torch_same_tokens"] = float((out["triton"][1] == out["torch"][1]).float().mean())
    part.check(f"triton_matches_torch_b{batch}_c{context}", err <= tol)
    return row


def time_target(
    ctx: StepContext, bench: Bench, target: tuple[nn.Module, nn.Module], batch: int, context: int
) -> dict[str, Any]:
    """One target decoder layer decoding a token per request over `context` cached ones, and
    the LM head, eager and (CUDA) graph-replayed."""
    time_ms, s = timer(ctx.device), bench.sizes
    layer, rotary = target
    cache = StaticKV(batch, context, s, ctx.device, ctx.dtype)
    h = torch.randn(batch, 1, s.shape.hidden_size, device=ctx.device, dtype=ctx.dtype)
    position_ids = torch.full((batch, 1), context, device=ctx.device)
    with torch.inference_mode():
        cos_sin = rotary(h, position_ids)

        def decode() -> torch.Tensor:
            out: torch.Tensor = layer(
                h, position_ids=position_ids, past_key_values=cache, position_embeddings=cos_sin
            )
            return out

        last = h[:, 0]
        # A draft vocabulary (`--draft-vocab N`): the head's rows of N tokens gathered once,
        # a step's argmax over them mapped to target ids (vllm_plugin/draft_vocab.py's math).
        n = min(DRAFT_VOCAB, s.shape.vocab_size // 4)
        rows = bench.head.weight[:n].contiguous()
        ids = torch.arange(n, device=ctx.device)
        row: dict[str, Any] = {
            "layer_eager_ms": time_ms(decode),
            "head_ms": time_ms(lambda: bench.head(last).argmax(dim=-1)),
            "draft_vocab": n,
            "draft_vocab_head_ms": time_ms(lambda: ids[(last @ rows.T).argmax(dim=-1)]),
        }
        if not ctx.cpu:
            captured = guarded(
                ctx.part, f"layer_graph_b{batch}_c{context}", lambda: graphed(decode)
            )
            if captured is not None:
                row["layer_graph_ms"] = time_ms(captured[0].replay)
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    row["layer_bytes"] = weights + 2 * cache.key.numel() * cache.key.element_size()
    return row


def time_page_rows(ctx: StepContext, bench: Bench, rows: int) -> dict[str, Any]:
    """The page rows of `rows` verified tokens: LSA over their K|V of every target layer with
    the layer-attention kernel (`VLLM_MOA_KERNELS=1`; the interpreter on the CPU) and with
    PyTorch (0)."""
    s, time_ms = bench.sizes.shape, timer(ctx.device)
    g = torch.Generator().manual_seed(1)
    layer_kv = torch.randn(rows, s.num_layers, 2 * s.kv_width, generator=g)
    embeds = torch.randn(rows, s.hidden_size, generator=g)
    args = (
        bench.drafter,
        embeds.to(ctx.device, ctx.dtype),
        layer_kv.to(ctx.device, ctx.dtype),
        torch.arange(rows, device=ctx.device),
    )
    row: dict[str, Any] = {"rows": rows}
    outs = {}
    with torch.inference_mode():
        for name, switch in (("kernel", "1"), ("torch", "0")):
            os.environ["VLLM_MOA_KERNELS"] = switch  # read at every call (model.layers)
            outs[name] = page_rows(*args)
            row[f"{name}_ms"] = time_ms(lambda: page_rows(*args))
    os.environ.pop("VLLM_MOA_KERNELS")
    row["relative_error"] = max(relative_error(a, b) for a, b in zip(*outs.values(), strict=True))
    return row


def ratios(row: dict[str, Any], layers: int, peak: float | None) -> None:
    """c = draft step / target step (layers x one layer + the LM head), eager and graphed."""
    for mode in ("eager", "graph"):
        draft, layer = row.get(f"triton_{mode}_ms"), row.get(f"layer_{mode}_ms")
        if draft is None or layer is None:
            continue
        target = layers * layer + row["head_ms"]
        row[f"target_step_{mode}_ms"] = target
        row[f"c_{mode}"] = draft / target
        row[f"c_tli1_{mode}"] = (draft + layer) / target  # TLI 1 adds one target layer
        # the same step drafting over a draft vocabulary: its head in place of the full one
        row[f"c_draft_vocab_{mode}"] = (
            draft - row["head_ms"] + row["draft_vocab_head_ms"]
        ) / target
        if peak:
            row[f"draft_{mode}_fraction_of_peak"] = row["draft_bytes"] / (draft * 1e-3) / peak
            row[f"layer_{mode}_fraction_of_peak"] = row["layer_bytes"] / (layer * 1e-3) / peak


def run_step(ctx: StepContext) -> None:
    part = ctx.part
    bench = build(ctx)
    s = bench.sizes
    card = ctx.earlier("1_env").get("card", "cpu")
    peak = None if ctx.cpu else peak_bandwidth(card)
    part.figures.update(
        target=s.shape.__dict__,
        drafter="paper preset, random weights, TLI 0",
        dtype=str(ctx.dtype),
        block_size=BLOCK_SIZE,
        cache_layout="FLASH_ATTN [num_blocks, num_kv_heads, block_size, 2 * head_size]",
        drafter_parameters=sum(p.numel() for p in bench.drafter.parameters()),
        rows=[],
    )
    if ctx.cpu:
        part.notes.append("CPU mode: CUDA-graph capture skipped (no CUDA); wall-clock timings")
    target = target_layer(s, ctx.device, ctx.dtype)
    for context in s.contexts:
        for batch in s.batches:
            row = time_draft(ctx, bench, batch, context)
            row["draft_bytes"] = draft_bytes(bench, batch, context)
            row.update(time_target(ctx, bench, target, batch, context))
            ratios(row, s.shape.num_layers, peak)
            part.figures["rows"].append(row)
            part.save()
    part.figures["page_rows"] = [time_page_rows(ctx, bench, n) for n in s.batches]
    tol = 1e-4 if ctx.cpu else 3e-2
    worst = max(r["relative_error"] for r in part.figures["page_rows"])
    part.check("page_rows_kernel_matches_torch", worst <= tol)
