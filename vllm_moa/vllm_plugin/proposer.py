"""The MoA proposer inside vLLM's V1 model runner: chain drafts for every running request at once.

The drafter's state lives in paged KV blocks that vLLM allocates, accounts and frees with the
target's (`pages.DrafterPages`: extra attention layers in the target's KV-cache group), at each
token position p:
- the CA memory K/V of verified token p: the target's K|V of every layer at p, read from its
  paged cache (by slot), through LSA + mean + Ekv2E once;
- the SA K/V of token p (it depends on the token and position only).
After each target step the proposer writes the rows of the newly verified tokens (all tokens with
target K/V in the cache: all but the one just sampled), then drafts K tokens greedily from the
last sampled token, exactly as the standalone engine's `MoAProposer` does (a test checks they
agree token for token). Each draft step runs one query per request and reads the history where
it lives (`paged_attention`: vLLM's own paged-attention ops on the CPU): SA over the SA pages,
into which the step first writes its own K/V; CA over the memory pages; TLI through the target's
own last layers, attending over the target's paged cache, into which the drafted positions' K/V
are written at slots the scheduler reserved for them (lookahead slots, as for vLLM's EAGLE; the
next target step overwrites them with the verified K/V before reading them). Nothing of a
request's history is copied per cycle. Greedy drafts keep vLLM's rejection sampler lossless at
any temperature (it treats the draft as a point mass).

Per request the proposer keeps only how many positions it has written and for which block
allocation: chunked prefill needs nothing special (rows are written up to whatever the target
cache holds when a request next drafts), and a request resumed after preemption (vLLM hands it
new blocks) or a reused request id gets its rows rewritten from position 0.

How many tokens each request drafts is chosen per step (vllm_moa/adaptive.py; unless the
speculative config says "moa_adaptive": false or VLLM_MOA_ADAPTIVE=0): from its acceptance so
far and the measured costs of the draft phase and of the target's decode step (from the
runner's execute_model to the proposer). A request given 0 drafts costs nothing that step: its
rows are written when it next drafts. A seeded request at temperature > 0 gets no drafts at all:
the lengths follow measured times and its random draws follow the lengths, so its text would not
repeat; with no drafts it is plain decoding's text for that seed (vLLM draws nothing for a
request without drafts). With "moa_adaptive": false it drafts K, repeatable at that K.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from vllm_moa.adaptive import (
    AcceptanceTracker,
    AdaptiveLengths,
    DraftGuard,
    StepCosts,
    adaptive_enabled,
)
from vllm_moa.vllm_plugin.drafting import (
    TRACE_ENV,
    CacheLayout,
    DraftInputs,
    MoADraftCore,
    PageRows,
)
from vllm_moa.vllm_plugin.kv_reader import slots_for_positions
from vllm_moa.vllm_plugin.loading import load_core
from vllm_moa.vllm_plugin.logs import LOGGER_NAME
from vllm_moa.vllm_plugin.tensor_parallel import same_on_every_rank
from vllm_moa.vllm_plugin.uploads import upload

logger = logging.getLogger(LOGGER_NAME)

# Diagnosing adaptive speculation: append one JSON line per engine step (its size, time, the
# drafts chosen, the cost model; docs/vllm_performance.md).
STEP_TRACE_ENV = "VLLM_MOA_STEP_TRACE"


@dataclass
class RequestState:
    """What the proposer remembers of a request: how many leading positions have their memory
    and SA rows written in the drafter's pages, and for which block allocation. vLLM gives a new
    request (or a request id reused) a new `block_ids` object and replaces it when it resumes a
    preempted request with new blocks, so identity tells when the pages must be rewritten."""

    block_ids: Any  # the runner's CachedRequestState.block_ids the pages were written for
    written: int = 0  # positions 0..written-1 (verified tokens) have memory + SA rows
    tracker: AcceptanceTracker | None = None  # adaptive speculation: its acceptance so far


class MoAVllmProposer:
    """Built by vLLM's `custom_class` branch (see patches.py) with the VllmConfig."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        # vLLM's dynamic speculation schedule (validated in the config step): the most a step
        # drafts at each batch size; adaptive speculation chooses within it.
        self.schedule = list(getattr(spec, "num_speculative_tokens_per_batch_size", None) or [])
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("MoA speculative decoding does not support pipeline parallelism")
        # Tensor parallelism (tensor_parallel.py): each rank runs the whole drafter on the K/V
        # of every head, gathered from the ranks, and rank 0 chooses the draft lengths.
        self.tp = int(parallel.tensor_parallel_size)
        self.core: MoADraftCore | None = None
        self.states: dict[str, RequestState] = {}
        # Adaptive speculation (vllm_moa/adaptive.py): acceptance prior, costs, chosen lengths.
        self.adaptive = adaptive_enabled() and bool(getattr(spec, "moa_adaptive", True))
        self.lengths = AdaptiveLengths(
            self.num_speculative_tokens, StepCosts(cold_phases=1), guard=DraftGuard()
        )
        self._chosen_logged = time.monotonic()
        # The draft phase before the next verify: its seconds and the cost model's prediction
        # of them (0: none yet); see _propose_in_runner.
        self._last_phase: tuple[float, float] | None = None
        self._phase_seen: tuple[int, int, int, float] | None = None  # (m, s, w, seconds), traces
        logger.info("MoA runs on vLLM's V1 model runner")

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "MoAVllmProposer is driven by the vllm_moa plugin (propose_in_runner); the plugin's "
            "patches are not active in this process. Is vllm_moa installed in this environment?"
        )

    # -- start-up ------------------------------------------------------------------------------

    def load_model(self, target_model: torch.nn.Module) -> None:
        self.core = load_core(target_model, self.vllm_config, self.tp)

    # -- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_in_runner(
        self, runner: Any, scheduler_output: Any, sampled_token_ids: list[list[int]]
    ) -> list[list[int]]:
        """Drafts for the requests of the step just run (one list per request of the input
        batch, empty where nothing is drafted); `VLLM_MOA_STEP_TRACE=FILE` logs each step."""
        path = os.environ.get(STEP_TRACE_ENV)
        if not path:
            return self._propose_in_runner(runner, scheduler_output, sampled_token_ids)
        began = time.perf_counter()
        out = self._propose_in_runner(runner, scheduler_output, sampled_token_ids)
        costs = self.lengths.costs
        record = {
            "time": began,
            "step_s": began - getattr(runner, "_vllm_moa_step_start", began),
            "draft_s": time.perf_counter() - began,
            "tokens": int(scheduler_output.total_num_scheduled_tokens),
            "requests": len(scheduler_output.num_scheduled_tokens),
            "verified_drafts": sum(
                len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values()
            ),
            "emitted": sum(len(t) for t in sampled_token_ids),
            "drafts": sum(len(d) for d in out),
            "model_ms": [1e3 * costs.base, 1e3 * costs.per_token, 1e3 * costs.draft_step],
            # the draft phase's model c + d * m + e * s + r * w (ms), and this step's (m, s, w, s)
            "draft_model_ms": [
                1e3 * c
                for c in (costs.draft_base, costs.draft_step, costs.draft_each, costs.draft_row)
            ],
            "phase": self._phase_seen,
            "vetoed": self.lengths.guard.vetoed,
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    def _propose_in_runner(
        self, runner: Any, scheduler_output: Any, sampled_token_ids: list[list[int]]
    ) -> list[list[int]]:
        # The draft phase before this step's verify (seconds), if the step before chose lengths.
        self._last_phase, last_phase = None, self._last_phase
        self._phase_seen = None
        batch = runner.input_batch
        req_ids: list[str] = list(batch.req_ids)
        for gone in set(self.states) - set(runner.requests):
            del self.states[gone]
        drafts: list[list[int]] = [[] for _ in req_ids]
        core = self.core
        if core is None:
            return drafts
        if core.layout is None:
            core.layout = CacheLayout.of(runner.kv_cache_config, runner.attn_groups)
        if not core.ready():
            return drafts  # profiling run: no cache bound yet
        rows: list[int] = []
        budgets: list[int] = []
        lengths: list[int] = []
        states: list[RequestState] = []
        # Every step visits every request: locals keep the loop cheap at large batches.
        k, max_len = self.step_cap(len(req_ids)), self.max_model_len
        known, requests = self.states, runner.requests
        seeded = batch.generators if self.adaptive else {}
        num_tokens = batch.num_tokens_no_spec
        for row, rid in enumerate(req_ids[: len(sampled_token_ids)]):
            if not sampled_token_ids[row]:
                continue  # partial prefill chunk or discarded: nothing to draft from
            if row in seeded and rid in batch.random_reqs:
                continue  # seeded sampling: no drafts, so the seed repeats (see the docstring)
            n = int(num_tokens[row])
            budget = min(k, max_len - n)
            if budget <= 0:
                continue
            block_ids = requests[rid].block_ids
            state = known.get(rid)
            if state is None or state.block_ids is not block_ids or state.written > n - 1:
                # new, reused id, or resumed after preemption (new blocks): rewrite the pages
                tracker = state.tracker if state is not None else None
                state = known[rid] = RequestState(block_ids, tracker=tracker)
            rows.append(row)
            budgets.append(budget)
            lengths.append(n)
            states.append(state)
        if not rows:
            return drafts
        if self.adaptive:
            ks = self._choose(
                runner,
                scheduler_output,
                req_ids,
                rows,
                states,
                budgets,
                lengths,
                sampled_token_ids,
                last_phase,
            )
            self._last_phase = (0.0, 0.0)
            keep = [i for i, k in enumerate(ks) if k > 0]
            rows, states = [rows[i] for i in keep], [states[i] for i in keep]
            budgets, lengths = [ks[i] for i in keep], [lengths[i] for i in keep]
            if not rows:
                return drafts
        # Each request's tokens from its first position without page rows to its last token.
        pending = [
            batch.token_ids_cpu[r, s.written : n].tolist()
            for r, s, n in zip(rows, states, lengths, strict=True)
        ]
        began = time.perf_counter()
        self._write_pages(core, runner, states, pending)
        chains = self._draft(core, runner, rows, states, pending, budgets)
        done = time.perf_counter()
        # The draft phase: rows written for the tokens just verified (and for those a request
        # skipped while it did not draft), then the draft steps.
        written = sum(len(p) - 1 for p in pending)
        costs = self.lengths.costs
        if self.adaptive:
            predicted = costs.draft_time(max(budgets), sum(budgets), written) if costs.known else 0
            self._last_phase = (done - began, predicted)
        costs.observe_draft(max(budgets), done - began, sum(budgets), written)
        self._phase_seen = (max(budgets), sum(budgets), written, done - began)
        if self.adaptive and self.lengths.probes.probing:
            self.lengths.probes.spent(done - began)
        for row, budget, chain in zip(rows, budgets, chains, strict=True):
            drafts[row] = chain[:budget]
        trace = os.environ.get(TRACE_ENV)
        if trace:
            with open(trace, "a") as f:
                for row, n in zip(rows, lengths, strict=True):
                    toks = batch.token_ids_cpu[row, :n].tolist()
                    f.write(json.dumps({"tokens": toks, "drafts": drafts[row]}) + "\n")
        return drafts

    def step_cap(self, batch_size: int) -> int:
        """Drafts per request at most this step: the schedule's entry for the batch size, else
        num_speculative_tokens."""
        for start, end, drafts in self.schedule:
            if start <= batch_size <= end:
                return int(drafts)
        return self.num_speculative_tokens

    # -- adaptive speculation ------------------------------------------------------------------

    def _choose(
        self,
        runner: Any,
        scheduler_output: Any,
        req_ids: list[str],
        rows: list[int],
        states: list[RequestState],
        budgets: list[int],
        lengths: list[int],
        sampled_token_ids: list[list[int]],
        last_phase: tuple[float, float] | None,
    ) -> list[int]:
        """Record the step just verified (the target's time for its tokens, from the runner's
        execute_model to here; each request's accepted drafts; for the guard, its tokens over
        its time and that of the draft phase before it, `last_phase`, against the cost model's
        prediction of both), then choose how many tokens each request drafts now."""
        started = getattr(runner, "_vllm_moa_step_start", None)
        verified = scheduler_output.scheduled_spec_decode_tokens
        tokens = int(scheduler_output.total_num_scheduled_tokens)
        in_step = len(scheduler_output.num_scheduled_tokens)
        decode_only = tokens == in_step + sum(len(v) for v in verified.values())
        if started is not None and tokens > 0 and not decode_only:
            # A prompt chunk's per-token cost is not a draft's, but bounds it at large steps.
            self.lengths.costs.observe_prefill(tokens, time.perf_counter() - started)
        if started is not None and tokens > 0 and decode_only:
            seconds = time.perf_counter() - started
            costs = self.lengths.costs
            if last_phase is not None:
                phase, phase_predicted = last_phase
                predicted = costs.verify_time(tokens) + phase_predicted if costs.known else 0.0
                if phase and not phase_predicted:
                    predicted = 0.0  # drafted before the model knew the draft phase: not counted
                emitted = sum(len(t) for t in sampled_token_ids)
                self.lengths.observe_step(in_step, seconds + phase, predicted, emitted)
            costs.observe_verify(tokens, seconds)
        trackers: list[AcceptanceTracker] = []
        catch_up: list[int] = []  # history rows to write before drafting
        remaining: list[int] = []  # tokens each request may still generate
        requests = runner.requests
        for row, state, n in zip(rows, states, lengths, strict=True):
            tracker = state.tracker
            if tracker is None:
                tracker = state.tracker = self.lengths.tracker()
            drafted = len(verified.get(req_ids[row], ()))  # ours: patch 4 (drafter fits)
            tracker.observe(drafted, max(len(sampled_token_ids[row]) - 1, 0))
            trackers.append(tracker)
            catch_up.append(n - state.written - 1)  # all pending tokens but the last
            request = requests[req_ids[row]]
            params = request.sampling_params
            limit = params.max_tokens if params is not None else None
            left = self.max_model_len - n
            remaining.append(min(left, limit - len(request.output_token_ids)) if limit else left)
        ks = self.lengths.choose(trackers, budgets, catch_up, remaining, len(req_ids))
        if self.tp > 1:  # the lengths follow each rank's own timings: rank 0's decide
            ks = same_on_every_rank(ks)
        if time.monotonic() - self._chosen_logged > 30.0:
            self._chosen_logged = time.monotonic()
            logger.info("MoA adaptive speculation: %s", self.lengths.summary())
        return ks

    def _span_slots(
        self,
        key: tuple[int, int],
        block_ids: list[tuple[list[int], ...]],
        spans: list[tuple[int, int]],
        device: torch.device,
    ) -> torch.Tensor:
        group, block_size = key
        return torch.cat(
            [
                slots_for_positions(ids[group], block_size, a, b, device)
                for ids, (a, b) in zip(block_ids, spans, strict=True)
            ]
        )

    def _write_pages(
        self,
        core: MoADraftCore,
        runner: Any,
        states: list[RequestState],
        pending: list[list[int]],
    ) -> None:
        """Memory and SA rows for every newly verified token (all pending but the last, whose
        SA row the first draft step writes and which has no target K/V yet)."""
        todo = [i for i, p in enumerate(pending) if len(p) > 1]
        if not todo:
            return
        spans = [(states[i].written, states[i].written + len(pending[i]) - 1) for i in todo]
        block_ids = [states[i].block_ids for i in todo]
        device = core.device
        core.write_rows(
            PageRows(
                token_ids=upload([t for i in todo for t in pending[i][:-1]], device),
                positions=upload(torch.cat([torch.arange(a, b) for a, b in spans]), device),
                slots={
                    key[0]: self._span_slots(key, block_ids, spans, device) for key in core.groups
                },
            )
        )
        for i, (_, end) in zip(todo, spans, strict=True):
            states[i].written = end

    def _block_table(self, runner: Any, rows: list[int], key: tuple[int, int]) -> torch.Tensor:
        """int32 [B, n] block tables of the batch rows `rows` for the KV-cache group of `key`, from
        the runner's own host copy (kept up to date by the runner for this step)."""
        group, block_size = key
        table = runner.input_batch.block_table[group]
        if table.block_size != block_size:
            raise RuntimeError(
                f"vllm_moa: the runner's block table uses blocks of {table.block_size} tokens, "
                f"the KV-cache group {block_size}: kernel block sizes that split a scheduler "
                "block are not supported"
            )
        host = table.get_cpu_tensor()
        index = torch.tensor(rows, dtype=torch.long)
        width = int(table.num_blocks_per_row[rows].max())
        assert self.core is not None
        return upload(host[index, :width], self.core.device)

    def _draft(
        self,
        core: MoADraftCore,
        runner: Any,
        rows: list[int],
        states: list[RequestState],
        pending: list[list[int]],
        budgets: list[int],
    ) -> list[list[int]]:
        """max(budgets) greedy drafts per request; one host sync, at the end."""
        device = core.device
        verified = [s.written for s in states]  # each last token's position
        chains = core.draft(
            DraftInputs(
                tokens=upload([p[-1] for p in pending], device),
                positions=upload(verified, device),
                ends=upload([n + b for n, b in zip(verified, budgets, strict=True)], device),
                block_tables={key[0]: self._block_table(runner, rows, key) for key in core.groups},
                max_seq_len=max(verified) + 1,
                steps=max(budgets),
            )
        )
        out: list[list[int]] = chains.tolist()
        return out
