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

How many tokens each request drafts is chosen per step (decoding/adaptive.py; unless the
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_moa.checkpoint.io import load_drafter
from vllm_moa.decoding.adaptive import (
    AcceptanceTracker,
    AdaptiveLengths,
    DraftGuard,
    StepCosts,
    adaptive_enabled,
)
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.vllm_plugin.compiled import Compiled, compile_wanted
from vllm_moa.vllm_plugin.cpu_linear import dispatch_linears
from vllm_moa.vllm_plugin.kv_reader import (
    CpuBlockLayout,
    check_backend,
    gather_layer_kv,
    slots_for_positions,
)
from vllm_moa.vllm_plugin.paged_attention import PADDING_SLOT, PagedKV, bind_stores
from vllm_moa.vllm_plugin.pages import DrafterPages
from vllm_moa.vllm_plugin.patches import LOGGER_NAME
from vllm_moa.vllm_plugin.target_view import VllmTargetView
from vllm_moa.vllm_plugin.tensor_parallel import gather_kv_heads, same_on_every_rank
from vllm_moa.vllm_plugin.uploads import upload

logger = logging.getLogger(LOGGER_NAME)

# "0": the drafter's linear layers use torch.nn.functional.linear on the CPU instead of vLLM's
# CPU GEMM dispatch (for comparisons).
CPU_GEMM_ENV = "VLLM_MOA_CPU_GEMM"

# Debugging and tests: append one JSON line {"tokens": [...], "drafts": [...]} per drafted request.
TRACE_ENV = "VLLM_MOA_TRACE"
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
        if getattr(vllm_config.model_config, "use_mla", False):
            raise ValueError("MoA needs per-layer K/V: MLA targets are not supported")
        self.drafter: MoADrafter | None = None
        self.target: VllmTargetView | None = None
        self.states: dict[str, RequestState] = {}
        self.pages: DrafterPages | None = None
        self._where: dict[str, tuple[int, int]] | None = None  # layer name: group, block size
        self._cpu_layouts: dict[tuple[Any, ...], CpuBlockLayout] = {}
        self._stores: dict[str, PagedKV] | None = None  # SA and memory pages
        self._bound = False  # the KV caches are bound (after vLLM's profiling run)
        # Adaptive speculation (decoding/adaptive.py): acceptance prior, costs, chosen lengths.
        self.adaptive = adaptive_enabled() and bool(getattr(spec, "moa_adaptive", True))
        self.lengths = AdaptiveLengths(
            self.num_speculative_tokens, StepCosts(cold_phases=1), guard=DraftGuard()
        )
        self._chosen_logged = time.monotonic()
        # The draft phase before the next verify: its seconds and the cost model's prediction
        # of them (0: none yet); see _propose_in_runner.
        self._last_phase: tuple[float, float] | None = None
        self._phase_seen: tuple[int, int, int, float] | None = None  # (m, s, w, seconds), traces
        # The hot functions, compiled where vLLM compiles the target (compiled.py).
        self._draft_step: Callable[..., torch.Tensor] = paged_draft_step
        self._page_rows: Callable[..., tuple[torch.Tensor, ...]] = page_rows

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "MoAVllmProposer is driven by the vllm_moa plugin (propose_in_runner); the plugin's "
            "patches are not active in this process. Is vllm_moa installed in this environment?"
        )

    # -- start-up ------------------------------------------------------------------------------

    def load_model(self, target_model: torch.nn.Module) -> None:
        spec = self.vllm_config.speculative_config
        hf_config = self.vllm_config.model_config.hf_text_config
        target = VllmTargetView(target_model, hf_config)
        device = next(target_model.parameters()).device
        dtype = self.vllm_config.model_config.dtype
        drafter = load_drafter(spec.model, target=target.shape, dtype=dtype, device=device)
        if not isinstance(drafter, MoADrafter):
            raise ValueError(f"{spec.model} is not a MoA drafter")
        if not drafter.uses_lsa:
            raise ValueError(
                "this drafter reads the target's last hidden states (memory_source 'hidden', "
                "the -LSA ablation); inside vLLM only LSA drafters (memory_source 'lsa') are "
                "supported"
            )
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        for attn in target.attn_layers:
            check_backend(attn.attn_backend.get_name(), str(cache_dtype))
        self.target = target
        if device.type == "cpu" and os.environ.get(CPU_GEMM_ENV, "1") != "0":
            dispatch_linears(drafter)  # vLLM's CPU GEMMs, as the target's layers use
        self.drafter = drafter.eval()
        self.device = device
        sa, ca = drafter.self_attention.self_attn, drafter.cross_attention.self_attn
        self.pages = DrafterPages(
            {"memory": (ca.num_kv_heads, ca.head_dim), "sa": (sa.num_kv_heads, sa.head_dim)},
            like=target.attn_layers[0],
            vllm_config=self.vllm_config,
        )
        compiled = compile_wanted(self.vllm_config)
        if compiled:
            began = time.perf_counter()
            self._compile()
            logger.info("MoA drafter compiled in %.1f s", time.perf_counter() - began)
        logger.info(
            "MoA drafter %s loaded: TLI=%d, K=%d, backend %s, %s",
            spec.model,
            drafter.config.tli,
            self.num_speculative_tokens,
            target.attn_layers[0].attn_backend.get_name(),
            "compiled" if compiled else "eager",
        )

    @torch.inference_mode()
    def _compile(self) -> None:
        """Compile the draft step and the page-row function and warm both up on stand-in pages,
        for one row and for several: dynamic shapes, so every batch reuses these graphs (one
        row keeps graphs of its own, as PyTorch specialises size 1; padding it to two rows
        instead costs more than it saves, e.g. oneDNN's GEMMs are slower for 2 rows than 1)."""
        drafter, target, pages = self.drafter, self.target, self.pages
        assert drafter is not None and target is not None and pages is not None
        backend = target.attn_layers[0].attn_backend.get_name()
        block_size = int(self.vllm_config.cache_config.block_size)
        stores = {
            name: pages.stand_in(name, drafter.dtype, backend, 8, block_size)
            for name in pages.fields
        }
        device, shape = self.device, target.shape
        step, rows = Compiled(paged_draft_step), Compiled(page_rows)
        bind_stores(stores)
        for n in (3, 1):
            positions = torch.arange(5, 5 + 7 * n, 7, device=device)
            table = torch.arange(2, 2 + 2 * n, dtype=torch.int32, device=device).view(n, 2)
            step.warm(
                drafter, stores, table, block_size,
                torch.zeros(n, shape.hidden_size, dtype=self._target_dtype, device=device),
                positions,
                positions + self.num_speculative_tokens, positions.to(torch.int32),
                torch.ones(n, 1, 1, dtype=torch.long, device=device),
            )  # fmt: skip
            layer_kv = torch.zeros(
                n, shape.num_layers, 2 * shape.num_kv_heads * shape.head_dim,
                dtype=drafter.dtype, device=device,
            )  # fmt: skip
            embeds = torch.zeros(n, shape.hidden_size, dtype=drafter.dtype, device=device)
            rows.warm(drafter, embeds, layer_kv, positions)
        self._draft_step, self._page_rows = step, rows

    def _groups(self, runner: Any, names: list[str]) -> list[tuple[int, int]]:
        """(KV-cache group, scheduler block size) of each named layer."""
        if self._where is None:
            self._where = {}
            for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
                for name in group.layer_names:
                    self._where[name] = (g, int(group.kv_cache_spec.block_size))
        return [self._where[name] for name in names]

    def _page_key(self, runner: Any) -> tuple[int, int]:
        """(group, block size) of the page layers: all in one KV-cache group."""
        assert self.pages is not None
        (key,) = set(self._groups(runner, self.pages.layer_names))
        return key

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
        if self.drafter is None or self.target is None or self.pages is None:
            return drafts
        if not self._cache_bound():
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
        self._bind_stores(runner)
        began = time.perf_counter()
        self._write_pages(runner, states, pending)
        chains = self._draft(runner, rows, states, pending, budgets)
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

    def _cache_bound(self) -> bool:
        """Whether vLLM has bound the KV caches (not yet during its profiling run); once they
        are, they stay bound."""
        if not self._bound:
            assert self.pages is not None and self.target is not None
            self._bound = self.pages.bound and all(
                a.kv_cache is not None and a.kv_cache.numel() > 0 for a in self.target.attn_layers
            )
        return self._bound

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

    def _read_layer_kv(
        self, runner: Any, block_ids: list[tuple[list[int], ...]], spans: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Target K|V rows [N, L, 2 * E_kv] (per layer [k_h0|v_h0|...]) for each request's
        position span, concatenated in request order."""
        assert self.target is not None
        attns = self.target.attn_layers
        keys = self._groups(runner, self.target.layer_names)
        rows: list[torch.Tensor | None] = [None] * len(attns)
        for key in dict.fromkeys(keys):  # each KV-cache group once, in order
            members = [i for i, k in enumerate(keys) if k == key]
            slots = self._span_slots(key, block_ids, spans)
            got = gather_layer_kv(
                [attns[i].kv_cache for i in members], slots, *self._cache_layout(attns[members[0]])
            )
            if self.tp > 1:  # this rank holds its share of the KV heads: all of them
                got = gather_kv_heads(got, self.target.shape.num_kv_heads, self.tp)
            if len(members) == len(attns):
                return got
            for j, i in enumerate(members):
                rows[i] = got[:, j]
        return torch.stack(rows, dim=1)  # type: ignore[arg-type]

    def _span_slots(
        self,
        key: tuple[int, int],
        block_ids: list[tuple[list[int], ...]],
        spans: list[tuple[int, int]],
    ) -> torch.Tensor:
        group, block_size = key
        return torch.cat(
            [
                slots_for_positions(ids[group], block_size, a, b, self.device)
                for ids, (a, b) in zip(block_ids, spans, strict=True)
            ]
        )

    def _cache_layout(self, attn: Any) -> tuple[str, CpuBlockLayout | None]:
        """The layer's backend name and, for CPU_ATTN, its probed in-block layout (cached)."""
        backend = attn.attn_backend.get_name()
        cache = attn.kv_cache
        assert self.target is not None
        if cache.shape[-1] != 2 * self.target.shape.head_dim:
            raise ValueError(
                f"{backend} KV cache rows are {cache.shape[-1]} wide, not 2 x head_dim "
                f"({self.target.shape.head_dim}): padded head sizes are not supported"
            )
        layout = None
        if backend == "CPU_ATTN":
            _, heads, block_size, width = cache.shape
            key = (heads, block_size, width // 2, cache.dtype, attn.isa)
            layout = self._cpu_layouts.get(key)
            if layout is None:
                layout = CpuBlockLayout.probe(heads, block_size, width // 2, cache.dtype, attn.isa)
                self._cpu_layouts[key] = layout
        return backend, layout

    def _write_pages(
        self, runner: Any, states: list[RequestState], pending: list[list[int]]
    ) -> None:
        """Memory and SA rows for every newly verified token (all pending but the last, whose
        SA row the first draft step writes and which has no target K/V yet)."""
        drafter, target, stores = self.drafter, self.target, self._stores
        assert drafter is not None and target is not None and stores is not None
        todo = [i for i, p in enumerate(pending) if len(p) > 1]
        if not todo:
            return
        spans = [(states[i].written, states[i].written + len(pending[i]) - 1) for i in todo]
        block_ids = [states[i].block_ids for i in todo]
        slots = self._span_slots(self._page_key(runner), block_ids, spans)
        positions = upload(torch.cat([torch.arange(a, b) for a, b in spans]), self.device)
        ids = upload([t for i in todo for t in pending[i][:-1]], self.device)
        layer_kv = self._read_layer_kv(runner, block_ids, spans).to(drafter.dtype)
        embeds = target.embed(ids).to(drafter.dtype)
        sa_k, sa_v, memory_k, memory_v = self._page_rows(drafter, embeds, layer_kv, positions)
        stores["sa"].write(sa_k, sa_v, slots)
        stores["memory"].write(memory_k, memory_v, slots)
        for i, (_, end) in zip(todo, spans, strict=True):
            states[i].written = end

    def _bind_stores(self, runner: Any) -> dict[str, PagedKV]:
        """The drafter's paged K/V stores (SA and memory pages), built once they are bound."""
        if self._stores is None:
            drafter, target, pages = self.drafter, self.target, self.pages
            assert drafter is not None and target is not None and pages is not None
            backend = target.attn_layers[0].attn_backend.get_name()
            self._stores = {
                name: pages.store(name, drafter.dtype, backend) for name in pages.fields
            }
            logger.info(
                "MoA drafter pages: %s",
                ", ".join(f"{n} {type(s).__name__}" for n, s in self._stores.items()),
            )
        return self._stores

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
        return upload(host[index, :width], self.device)

    def _draft(
        self,
        runner: Any,
        rows: list[int],
        states: list[RequestState],
        pending: list[list[int]],
        budgets: list[int],
    ) -> list[list[int]]:
        """max(budgets) greedy drafts per request; one host sync, at the end."""
        drafter, target = self.drafter, self.target
        assert drafter is not None and target is not None
        stores = self._stores
        assert stores is not None
        page_key = self._page_key(runner)
        table = self._block_table(runner, rows, page_key)
        block_size = page_key[1]
        tli = drafter.config.tli
        tail_names = target.layer_names[target.shape.num_layers - tli :]
        tail_keys = dict(zip(tail_names, self._groups(runner, tail_names), strict=True))
        tail_tables = {key: self._block_table(runner, rows, key) for key in tail_keys.values()}
        # Each last token's position, and the memory rows (verified tokens) every draft sees.
        verified = [s.written for s in states]
        positions = upload(verified, self.device)
        memory_lens = upload([max(n, 1) for n in verified], self.device).to(torch.int32)
        # A one-token prompt has no verified token yet: an empty memory (its CA output is zero).
        has_memory = upload([int(n > 0) for n in verified], self.device)[:, None, None]
        ends = upload([n + b for n, b in zip(verified, budgets, strict=True)], self.device)
        tokens = upload([p[-1] for p in pending], self.device)

        wide = widen(table, 2)  # a width of 1 would compile graphs of its own (compiled.py)
        bind_stores(stores)  # the pages the compiled step's attention ops act on
        drafted: list[torch.Tensor] = []
        for step in range(max(budgets)):
            # The embedding runs outside the compiled step: with tensor parallelism it is an
            # all-reduce over the vocabulary shards.
            h = self._draft_step(
                drafter, stores, wide, block_size, target.embed(tokens), positions, ends,
                memory_lens, has_memory,
            )  # fmt: skip
            # TLI=0 predicts the target's final (normalised) output; TLI=N ends with the target's
            # last N layers and final norm.
            if tli:
                h = target.run_tail(
                    tli,
                    h.to(self._target_dtype),
                    positions,
                    *self._tail_metadata(
                        runner, tail_keys, tail_tables, positions, ends, max(verified) + step + 1
                    ),
                    self.vllm_config,
                )
            tokens = target.logits(h.to(self._target_dtype)).argmax(dim=-1)
            drafted.append(tokens)
            positions = positions + 1
        chains: list[list[int]] = torch.stack(drafted, dim=1).tolist()
        return chains

    def _tail_metadata(
        self,
        runner: Any,
        tail_keys: dict[str, tuple[int, int]],
        tail_tables: dict[tuple[int, int], torch.Tensor],
        positions: torch.Tensor,
        ends: torch.Tensor,
        max_seq_len: int,
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Attention metadata (built by the runner's own builders) and slot mappings of the
        TLI layers for one draft step: one query per request at `positions`, over the request's
        cache up to and including it."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        rows = positions.shape[0]
        starts = torch.arange(rows + 1, dtype=torch.int32)
        lens = (positions + 1).to(torch.int32)
        metadata: dict[str, Any] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        for key in dict.fromkeys(tail_keys.values()):
            table = tail_tables[key]
            slots = draft_slots(positions, ends, table, key[1])
            common = CommonAttentionMetadata(
                query_start_loc=upload(starts, self.device),
                query_start_loc_cpu=starts,
                seq_lens=lens,
                num_reqs=rows,
                num_actual_tokens=rows,
                max_query_len=1,
                max_seq_len=max_seq_len,
                block_table_tensor=table,
                slot_mapping=slots,
                positions=positions,
            )
            names = [name for name, k in tail_keys.items() if k == key]
            for group in runner.attn_groups[key[0]]:
                mine = [name for name in names if name in group.layer_names]
                if mine:
                    built = group.get_metadata_builder().build(0, common)
                    metadata.update(dict.fromkeys(mine, built))
                    slot_mapping.update(dict.fromkeys(mine, slots))
        return metadata, slot_mapping

    @property
    def _target_dtype(self) -> torch.dtype:
        return self.vllm_config.model_config.dtype


def draft_slots(
    positions: torch.Tensor, ends: torch.Tensor, table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Slots [B] of each request's drafted position (block table [B, n]); positions at or past
    the request's end (its budget) have no reserved slot: PADDING_SLOT, never written."""
    index = (positions // block_size)[:, None].clamp(max=table.shape[1] - 1)
    slot = table.gather(1, index)[:, 0].long() * block_size + positions % block_size
    return torch.where(positions < ends, slot, PADDING_SLOT)


def page_rows(
    drafter: MoADrafter,
    token_embeds: torch.Tensor,  # [N, E]: the verified tokens' target embeddings
    layer_kv: torch.Tensor,  # [N, L, 2 * E_kv]: their target K|V of every layer
    positions: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The page rows of verified tokens: SA K, V (they depend on the token and position only)
    and CA memory K, V (LSA + mean + Ekv2E, then CA's K/V projection), each [N, Hkv, D]."""
    sa_k, sa_v = drafter.self_attention.kv_from(token_embeds[None], positions)
    memory = drafter.encode_memory(layer_kv)  # [N, E]
    memory_k, memory_v = drafter.memory_kv(memory[None], positions)
    return (
        sa_k[0].transpose(0, 1),
        sa_v[0].transpose(0, 1),
        memory_k[0].transpose(0, 1),
        memory_v[0].transpose(0, 1),
    )


def widen(table: torch.Tensor, width: int) -> torch.Tensor:
    """A block table [B, n] with columns of block 0 (vLLM's null block) appended up to `width`:
    the same table for attention, which reads each row only up to its length."""
    if table.shape[1] >= width:
        return table
    return torch.cat([table, table.new_zeros((table.shape[0], width - table.shape[1]))], dim=1)


def paged_draft_step(
    drafter: MoADrafter,
    stores: dict[str, PagedKV],
    table: torch.Tensor,  # int32 [B, n]: the rows' block tables
    block_size: int,
    token_embeds: torch.Tensor,  # [B, E]: the target's embeddings of each row's last token
    positions: torch.Tensor,  # [B]: their positions
    ends: torch.Tensor,  # [B]: the rows' first positions past their budget
    memory_lens: torch.Tensor,  # int32 [B]: memory rows each row sees (>= 1)
    has_memory: torch.Tensor,  # [B, 1, 1]: 0 where a row has no memory row yet
) -> torch.Tensor:
    """One draft step on the pages: SA (writing the rows' own K/V at their slots first) and CA,
    [B, E] before TLI and the LM head. No host sync and no data-dependent shape: a CUDA graph
    can capture it, and with PyTorch's paged attention it compiles as one graph (tested)."""
    slots = draft_slots(positions, ends, table, block_size)
    lens = (positions + 1).to(torch.int32)

    def self_attend(
        q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        assert k is not None and v is not None
        written = stores["sa"].write(k, v, slots)  # the step's own K/V first: it sees itself
        return stores["sa"].attend(q, table, lens, after=written)

    def cross_attend(q: torch.Tensor, *_: torch.Tensor | None) -> torch.Tensor:
        return stores["memory"].attend(q, table, memory_lens) * has_memory

    return drafter.draft_step(token_embeds.to(drafter.dtype), positions, self_attend, cross_attend)
