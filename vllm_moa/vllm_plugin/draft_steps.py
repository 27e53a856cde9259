"""Adaptive speculation on vLLM's V2 runner: how many draft steps the batch runs this step.

V2 schedules K draft slots per request before the drafts exist (the scheduler sees only
placeholders), so per-request lengths cannot shorten what is verified. What adaptive
speculation can still save there is the draft phase: the batch runs m <= K draft steps and the
slots past them hold padding (the last draft, or the last sampled token at m = 0), which the
target verifies like any draft (lossless; now and then accepted). m is chosen by
`AdaptiveLengths.choose_steps` (vllm_moa/adaptive.py): each request's acceptance per position,
and the measured costs of a draft step and of the verify step; a useless drafter ends at m = 0,
with a probe step now and then.

What it learns from is read without stalling the device: each step's verdict (`num_rejected`,
on the device) is copied to the host without blocking, and a step's record (its requests, the
drafts they verified, its times) is folded in only once its copy and its timing marks are done,
at the latest two steps later. Times are the host clock's on the CPU and CUDA events on a GPU
(the host runs ahead of the device there). Under tensor parallelism every rank records, and
rank 0's choice is every rank's (a host broadcast over the CPU group).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_moa.adaptive import AcceptanceTracker, AdaptiveLengths, StepCosts
from vllm_moa.vllm_plugin.tensor_parallel import rank0_value

# The target step's time from the previous draft phase's end: a gap longer than this many times
# the verify estimate is idle time (no requests), not a step.
IDLE_GAP = 8.0
# Steps recorded and not yet folded in, at most: the current one and two before it (`_fold`).
PENDING_MAX = 3


class StepClock:
    """Marks on the step's timeline: host seconds on the CPU, CUDA events on a GPU (GPU-only
    branch: the CPU build has no CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, mark: Any) -> bool:
        return not self.cuda or bool(mark.query())

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return float(end - start)
        return float(start.elapsed_time(end)) / 1e3


@dataclass
class _Step:
    """One propose call: its batch, the drafts it verified, its verdict and times."""

    req_ids: list[str]
    verified: np.ndarray  # draft slots each request verified in this step (host)
    drafted_before: int  # real drafts (not padding) in those slots: the previous step's m
    tokens: int  # the step's tokens
    prefill: bool  # the step computed prompt tokens
    rejected: torch.Tensor  # [num_reqs] host copy of the verdict, filled without blocking
    copied: Any  # the copy's CUDA event (None on the CPU)
    begin: Any  # mark: drafting starts (the page rows are written)
    target: tuple[Any, Any] | None  # marks around the target's step (previous draft end, begin)
    steps: int = 0  # draft steps this call ran (m)
    probe: bool = False
    draft: tuple[Any, Any] | None = None  # marks around the draft phase


class DraftSteps:
    """The V2 speculator's adaptive speculation: records each step, folds in what is ready, and
    chooses the next draft phase's m."""

    def __init__(self, k: int, device: torch.device, tp: int = 1) -> None:
        self.k = k
        self.device = device
        self.tp = tp
        self.lengths = AdaptiveLengths(k, StepCosts(cold_phases=1))
        self.trackers: dict[str, AcceptanceTracker] = {}
        self.clock = StepClock(device)
        self.pending: deque[_Step] = deque()
        self.last_steps = 0  # m of the previous call
        self.last_end: Any = None  # the previous draft phase's end mark
        self.current: _Step | None = None
        # Host buffers the verdicts are copied into (pinned on a GPU), one per step that can be
        # pending at once (`_fold` keeps at most two besides the current), reused in turn.
        self._verdicts: list[torch.Tensor] = []
        self._next_verdict = 0

    def begin(
        self, req_ids: list[str], verified: np.ndarray | None, tokens: int, prefill: bool,
        num_rejected: torch.Tensor,
    ) -> None:  # fmt: skip
        """A propose call starts drafting (the page rows are written): record the step."""
        now = self.clock.mark()
        n = len(req_ids)
        cuda = self.device.type == "cuda"
        rejected = self._verdict_buffer(n, num_rejected.dtype)
        rejected.copy_(num_rejected[:n], non_blocking=cuda)
        copied = None
        if cuda:  # GPU-only branch
            copied = torch.cuda.Event()
            copied.record()
        verified = np.zeros(n, dtype=np.int64) if verified is None else verified[:n].copy()
        target = (self.last_end, now) if self.last_end is not None else None
        step = _Step(list(req_ids), verified, self.last_steps, tokens, prefill, rejected, copied,
                     now, target)  # fmt: skip
        self.current = step
        self.pending.append(step)

    def choose(self, steps: int) -> int:
        """The draft steps (<= `steps`, what the runner scheduled) for the step begun."""
        step = self.current
        assert step is not None
        self._fold()
        live = set(step.req_ids)
        for req_id in [r for r in self.trackers if r not in live]:
            del self.trackers[req_id]  # finished or preempted (a preempted one starts afresh)
        trackers = [self._tracker(r) for r in step.req_ids]
        n = len(step.req_ids)
        probing_before = self.lengths.probes.steps
        m = self.lengths.choose_steps(trackers, steps, n * (1 + steps))
        step.probe = self.lengths.probes.probing and self.lengths.probes.steps > probing_before
        if self.tp > 1:  # each rank's times differ: rank 0's choice drafts on every rank
            m = rank0_value(m)
        step.steps = m
        return m

    def end(self) -> None:
        """The draft phase is issued."""
        step = self.current
        assert step is not None
        end = self.clock.mark()
        if step.steps:
            step.draft = (step.begin, end)
        self.last_end = end
        self.last_steps = step.steps
        self.current = None

    def summary(self) -> str:
        return self.lengths.summary()

    def _verdict_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The next of the `PENDING_MAX` host buffers, its first n entries (made again, larger,
        when a batch outgrows them: the pending steps keep the old ones alive)."""
        ring = self._verdicts
        if not ring or ring[0].numel() < n or ring[0].dtype != dtype:
            size = max(n, 2 * ring[0].numel() if ring else 64)
            pin = self.device.type == "cuda"
            self._verdicts = ring = [
                torch.empty(size, dtype=dtype, pin_memory=pin) for _ in range(PENDING_MAX)
            ]
        buffer = ring[self._next_verdict % PENDING_MAX]
        self._next_verdict += 1
        return buffer[:n]

    # -- learning ------------------------------------------------------------------------------

    def _tracker(self, req_id: str) -> AcceptanceTracker:
        tracker = self.trackers.get(req_id)
        if tracker is None:
            tracker = self.trackers[req_id] = self.lengths.tracker()
        return tracker

    def _fold(self) -> None:
        """Fold in the recorded steps whose verdict and times are ready (the current one's
        begin excepted: it is folded once its draft phase is measured), waiting on none but
        those two steps old."""
        while len(self.pending) > 1:
            step = self.pending[0]
            old = len(self.pending) > 2
            if not old and not self._ready(step):
                break
            if old and step.copied is not None:  # GPU-only branch: long done, in practice
                step.copied.synchronize()
            self.pending.popleft()
            self._learn(step)

    def _ready(self, step: _Step) -> bool:
        if step.copied is not None and not step.copied.query():
            return False
        return all(self._done(span) for span in (step.target, step.draft) if span is not None)

    def _learn(self, step: _Step) -> None:
        if step.drafted_before:
            trackers = self.trackers
            verdicts = zip(
                step.req_ids, step.verified.tolist(), step.rejected.tolist(), strict=True
            )
            for req_id, slots, rejected in verdicts:
                tracker = trackers.get(req_id)
                if slots <= 0 or tracker is None:
                    continue
                drafted = min(step.drafted_before, slots)
                tracker.observe(drafted, min(max(slots - rejected, 0), drafted))
        costs = self.lengths.costs
        if step.target is not None and self._done(step.target):
            seconds = self.clock.seconds(*step.target)
            if step.prefill:
                costs.observe_prefill(step.tokens, seconds)
            elif not costs.known or seconds < IDLE_GAP * costs.verify_time(step.tokens):
                costs.observe_verify(step.tokens, seconds)
        if step.draft is not None and self._done(step.draft):
            seconds = self.clock.seconds(*step.draft)
            costs.observe_draft(step.steps, seconds, step.steps * len(step.req_ids))
            if step.probe:
                self.lengths.probes.spent(seconds)

    def _done(self, span: tuple[Any, Any]) -> bool:
        return all(self.clock.done(m) for m in span)
