"""CUDA graphs of the V2 speculator's draft loop: one graph per (padded batch size, draft steps),
replayed on persistent input buffers, as vLLM V2's own speculators capture theirs.

`MoADraftCore.draft` reads no device value on the host and has no data-dependent shape (shown on
`meta` tensors by tests/vllm_integration/test_startup_devices.py), so a whole draft phase, m
draft steps of the drafter and the target's embedding and LM head, is one graph. A batch of B
requests replays the graph of the smallest captured size >= B: its rows are copied into the
buffers and the rows past B hold padding (position 0 and end 0: no SA slot is written; token 0;
an all-zero block table, vLLM's null block), whose drafts nobody reads.

With or without tensor parallelism, the capture runs inside vLLM's own `graph_capture` context,
on its stream, as vLLM's graphs of the target and of its own speculators are captured, so the
embedding's and the LM head's collectives across ranks are captured the way vLLM captures them
(and its custom all-reduce registers the graphs' buffers). With TLI, the tail layers' attention
metadata is built once per size over persistent buffers that every draft step refreshes on the
device (tail_attention.StaticTail), so the tail is in the graph too. Capture itself is GPU-only
(the CPU build has no CUDA); the buffers, padding and replay are tested on the CPU with an eager
stand-in for the graph (`tests/vllm_integration/test_draft_graphs.py`, and end to end on V2 with
vLLM's Triton attention backend in `test_vllm_v2_graphs.py`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_moa.vllm_plugin.drafting import DraftInputs, MoADraftCore
from vllm_moa.vllm_plugin.logs import LOGGER_NAME
from vllm_moa.vllm_plugin.tail_attention import StaticTail, TailLayers

logger = logging.getLogger(LOGGER_NAME)

# capture(fn) -> replay(): runs `fn` once more each replay, on whatever the buffers hold.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(pool: Any) -> Capture:
    """Capture with a CUDA graph in `pool`, on the current stream: called inside vLLM's
    `graph_capture` context, whose stream that is (GPU-only branch)."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        fn()  # warm: compiled code, caches and allocator settle before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream()):
            out = fn()
        return graph.replay, out

    return capture


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """The CPU stand-in for `cuda_capture`: each replay runs `fn` and writes into the output
    the capture returned (a graph's replay refills its output tensor)."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return replay, out


@dataclass
class _Buffers:
    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    ends: torch.Tensor  # [N] int64
    tables: dict[int, torch.Tensor]  # per KV-cache group: int32 [N, blocks]


class DraftGraphs:
    """Captured draft phases for batches up to `max(sizes)` requests and 1..`steps` draft steps.
    `run` returns None for a batch it has no graph for (larger, another block-table width).
    `tail`: the TLI layers (None for TLI = 0), whose metadata each size gets over its buffers."""

    def __init__(
        self,
        core: MoADraftCore,
        sizes: list[int],
        steps: int,
        table_widths: dict[int, int],
        max_seq_len: int,
        device: torch.device,
        tail: TailLayers | None = None,
    ) -> None:
        self.core = core
        self.tail = tail
        self.sizes = sorted(set(sizes))
        self.steps = steps
        self.max_seq_len = max_seq_len
        n = self.sizes[-1]
        self.buffers = _Buffers(
            tokens=torch.zeros(n, dtype=torch.long, device=device),
            positions=torch.zeros(n, dtype=torch.long, device=device),
            ends=torch.zeros(n, dtype=torch.long, device=device),
            tables={
                g: torch.zeros(n, w, dtype=torch.int32, device=device)
                for g, w in table_widths.items()
            },
        )
        self.graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self, capture: Capture) -> None:
        """One graph per (size, m), with the buffers holding padding."""
        self._pad(0)
        for size in self.sizes:
            tail = None
            if self.tail is not None:
                tables = {g: self.buffers.tables[g][:size] for g in self.tail.groups}
                tail = StaticTail(self.tail, tables, self.max_seq_len)
            for m in range(1, self.steps + 1):
                inputs = self._inputs(size, m)
                self.graphs[size, m] = capture(functools.partial(self.core.draft, inputs, tail))
        logger.info(
            "MoA draft loop captured: %d graphs (batch sizes %s, 1..%d draft steps)",
            len(self.graphs), self.sizes, self.steps,
        )  # fmt: skip

    @torch.inference_mode()
    def run(self, inputs: DraftInputs) -> torch.Tensor | None:
        """`core.draft(inputs)` by replaying a graph (None: none fits this batch)."""
        b = int(inputs.tokens.shape[0])
        size = next((s for s in self.sizes if s >= b), None)
        if size is None or (size, inputs.steps) not in self.graphs:
            return None
        buffers = self.buffers
        tables = inputs.block_tables
        if set(tables) != set(buffers.tables) or any(
            tables[g].shape[1] != buffers.tables[g].shape[1] for g in tables
        ):
            return None
        buffers.tokens[:b].copy_(inputs.tokens)
        buffers.positions[:b].copy_(inputs.positions)
        buffers.ends[:b].copy_(inputs.ends)
        for g, table in tables.items():
            buffers.tables[g][:b].copy_(table)
        self._pad(b)
        replay, out = self.graphs[size, inputs.steps]
        replay()
        return out[:b]

    def _pad(self, start: int) -> None:
        """Rows from `start` on: padding (drafts nobody reads, no slot written)."""
        buffers = self.buffers
        for t in (buffers.tokens, buffers.positions, buffers.ends, *buffers.tables.values()):
            t[start:].zero_()

    def _inputs(self, size: int, steps: int) -> DraftInputs:
        buffers = self.buffers
        return DraftInputs(
            tokens=buffers.tokens[:size],
            positions=buffers.positions[:size],
            ends=buffers.ends[:size],
            block_tables={g: t[:size] for g, t in buffers.tables.items()},
            max_seq_len=self.max_seq_len,
            steps=steps,
        )
