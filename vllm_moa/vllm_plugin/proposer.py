"""The MoA proposer inside vLLM's V1 model runner: chain drafts for every running request at once.

The drafter's state lives in paged KV blocks that vLLM allocates, accounts and frees with the
target's (`pages.DrafterPages`: extra attention layers in the target's KV-cache group), at each
verified token position p:
- the CA memory K|V of token p: the target's K|V of every layer at p, read from its paged cache
  (by block table), through LSA + mean + Ekv2E once;
- the SA K|V of token p (it depends on the token and position only).
After each target step the proposer writes the rows of the newly verified tokens (all tokens with
target K/V in the cache: all but the one just sampled), then drafts K tokens greedily from the
last sampled token, exactly as the standalone engine's `MoAProposer` does (a test checks they
agree token for token): SA over the pages plus this cycle's drafts, CA over the memory pages, TLI
through the target's own last layers (the verified prefix's K/V read from the target's pages; the
drafted positions' K/V stay in this cycle's tensors, so the verified cache is only read), the
target's LM head. Greedy drafts keep vLLM's rejection sampler lossless at any temperature (it
treats the draft as a point mass).

Per request the proposer keeps only how many positions it has written and for which block
allocation: chunked prefill needs nothing special (rows are written up to whatever the target
cache holds when a request next drafts), and a request resumed after preemption (vLLM hands it
new blocks) or a reused request id gets its rows rewritten from position 0.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from vllm_moa.checkpoint.io import load_drafter
from vllm_moa.model.moa import MoADrafter
from vllm_moa.vllm_plugin.kv_reader import (
    CpuBlockLayout,
    check_backend,
    gather_blocks,
    gather_layer_kv,
    slots_for_positions,
)
from vllm_moa.vllm_plugin.pages import DrafterPages, block_table, slot_grid
from vllm_moa.vllm_plugin.target_view import VllmTargetView
from vllm_moa.vllm_plugin.uploads import upload

logger = logging.getLogger("vllm_moa")

# Debugging and tests: append one JSON line {"tokens": [...], "drafts": [...]} per drafted request.
TRACE_ENV = "VLLM_MOA_TRACE"


@dataclass
class RequestState:
    """What the proposer remembers of a request: how many leading positions have their memory
    and SA rows written in the drafter's pages, and for which block allocation. vLLM gives a new
    request (or a request id reused) a new `block_ids` object and replaces it when it resumes a
    preempted request with new blocks, so identity tells when the pages must be rewritten."""

    block_ids: Any  # the runner's CachedRequestState.block_ids the pages were written for
    written: int = 0  # positions 0..written-1 (verified tokens) have memory + SA rows


@dataclass
class PaddedKV:
    """K/V [B, H, S, D] (rows of different lengths, padded; possibly strided views of a gather)
    with room to append positions per row (one per draft step) without re-padding."""

    k: torch.Tensor  # [B, H, S, D]
    v: torch.Tensor
    lengths: torch.Tensor  # long [B]

    @classmethod
    def from_rows(cls, rows: torch.Tensor, heads: int, lengths: torch.Tensor) -> PaddedKV:
        """rows [B, S, 2 * heads * D] as stored in the pages: per position [K | V]."""
        kv = rows.unflatten(-1, (2, heads, -1))  # [B, S, 2, H, D]
        return cls(kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), lengths.clone())

    @property
    def mask(self) -> torch.Tensor:
        """bool [B, 1, 1, S]: key j of row b is visible."""
        cols = torch.arange(self.k.shape[2], device=self.k.device)
        return (cols[None, :] < self.lengths[:, None])[:, None, None, :]

    def visible(self, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """`mask` for queries at positions [B], within a sliding window if there is one (for
        caches whose column j holds position j, as the TLI tail's do)."""
        if window is None:
            return self.mask
        cols = torch.arange(self.k.shape[2], device=self.k.device)
        return self.mask & (cols[None, :] > positions[:, None] - window)[:, None, None, :]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One more position per row: k, v [B, H, D]."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, self.lengths] = k.to(self.k.dtype)
        self.v[rows, :, self.lengths] = v.to(self.v.dtype)
        self.lengths += 1


def kv_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [1, H, N, D] -> page rows [N, 2 * H * D] ([K | V] per position)."""
    return torch.cat([k[0].transpose(0, 1).flatten(1), v[0].transpose(0, 1).flatten(1)], dim=-1)


class MoAVllmProposer:
    """Built by vLLM's `custom_class` branch (see patches.py) with the VllmConfig."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("MoA speculative decoding does not support pipeline parallelism")
        if parallel.tensor_parallel_size > 1:
            raise ValueError(
                "MoA speculative decoding does not support tensor parallelism yet "
                f"(tensor_parallel_size={parallel.tensor_parallel_size}); serve with TP=1"
            )
        if getattr(vllm_config.model_config, "use_mla", False):
            raise ValueError("MoA needs per-layer K/V: MLA targets are not supported")
        self.drafter: MoADrafter | None = None
        self.target: VllmTargetView | None = None
        self.states: dict[str, RequestState] = {}
        self.pages: DrafterPages | None = None
        self._where: dict[str, tuple[int, int]] | None = None  # layer name: group, block size
        self._cpu_layouts: dict[tuple[Any, ...], CpuBlockLayout] = {}

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
        if drafter.config.tli:
            target.check_tail(drafter.config.tli)
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        for attn in target.attn_layers:
            check_backend(attn.attn_backend.get_name(), str(cache_dtype))
        self.target = target
        self.drafter = drafter.eval()
        self.device = device
        sa, ca = drafter.self_attention.self_attn, drafter.cross_attention.self_attn
        self.pages = DrafterPages(
            {
                "memory": 2 * ca.num_kv_heads * ca.head_dim,
                "sa": 2 * sa.num_kv_heads * sa.head_dim,
            },
            like=target.attn_layers[0],
            vllm_config=self.vllm_config,
        )
        logger.info(
            "MoA drafter %s loaded: TLI=%d, K=%d, backend %s",
            spec.model,
            drafter.config.tli,
            self.num_speculative_tokens,
            target.attn_layers[0].attn_backend.get_name(),
        )

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
        batch = runner.input_batch
        req_ids: list[str] = list(batch.req_ids)
        for gone in set(self.states) - set(runner.requests):
            del self.states[gone]
        drafts: list[list[int]] = [[] for _ in req_ids]
        if self.drafter is None or self.target is None or self.pages is None:
            return drafts
        if not self.pages.bound or any(
            a.kv_cache is None or a.kv_cache.numel() == 0 for a in self.target.attn_layers
        ):
            return drafts  # profiling run: no cache bound yet
        rows: list[int] = []
        budgets: list[int] = []
        lengths: list[int] = []
        for row, rid in enumerate(req_ids):
            if row >= len(sampled_token_ids) or not sampled_token_ids[row]:
                continue  # partial prefill chunk or discarded: nothing to draft from
            n = int(batch.num_tokens_no_spec[row])
            budget = min(self.num_speculative_tokens, self.max_model_len - n)
            if budget <= 0:
                continue
            block_ids = runner.requests[rid].block_ids
            state = self.states.get(rid)
            if state is None or state.block_ids is not block_ids or state.written > n - 1:
                # new, reused id, or resumed after preemption (new blocks): rewrite the pages
                state = self.states[rid] = RequestState(block_ids)
            rows.append(row)
            budgets.append(budget)
            lengths.append(n)
        if not rows:
            return drafts
        states = [self.states[req_ids[r]] for r in rows]
        # Each request's tokens from its first position without page rows to its last token.
        pending = [
            batch.token_ids_cpu[r, s.written : n].tolist()
            for r, s, n in zip(rows, states, lengths, strict=True)
        ]
        last_k, last_v = self._write_pages(runner, states, pending)
        chains = self._draft(runner, states, pending, last_k, last_v, max(budgets))
        for row, budget, chain in zip(rows, budgets, chains, strict=True):
            drafts[row] = chain[:budget]
        trace = os.environ.get(TRACE_ENV)
        if trace:
            with open(trace, "a") as f:
                for row, n in zip(rows, lengths, strict=True):
                    toks = batch.token_ids_cpu[row, :n].tolist()
                    f.write(json.dumps({"tokens": toks, "drafts": drafts[row]}) + "\n")
        return drafts

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

    def _gather_blocks(self, attn: Any, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, n * block_size, Hkv, D] of whole blocks `table` [B, n]."""
        return gather_blocks(attn.kv_cache, table, *self._cache_layout(attn))

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

    @property
    def _dtype(self) -> torch.dtype:
        assert self.drafter is not None
        return self.drafter.cross_attention.dtype

    def _write_pages(
        self, runner: Any, states: list[RequestState], pending: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory and SA rows for every newly verified token (all pending but the last), written
        to the pages; returns the SA K/V [B, Hkv, D] of each request's last token (the first
        query of this draft, not yet verified: kept out of the pages)."""
        drafter, target, pages = self.drafter, self.target, self.pages
        assert drafter is not None and target is not None and pages is not None
        spans = [(s.written, s.written + len(p) - 1) for s, p in zip(states, pending, strict=True)]
        block_ids = [s.block_ids for s in states]
        group_key = self._page_key(runner)
        # SA: K/V of a position depends on its token only; one projection for all pending.
        ids = upload([t for p in pending for t in p], self.device)
        positions = upload(torch.cat([torch.arange(a, b + 1) for a, b in spans]), self.device)
        sa_k, sa_v = drafter.self_attention.kv_from(
            target.embed(ids).to(self._dtype)[None], positions
        )  # [1, Hkv, P, D]
        # Row indices (host-built: no device sync): each request's last token, and the rest.
        ends = [end - 1 for end in itertools.accumulate(len(p) for p in pending)]
        last_rows = upload(ends, self.device)
        verified_rows = upload(sorted(set(range(len(ids))) - set(ends)), self.device)
        todo = [i for i, (a, b) in enumerate(spans) if b > a]
        if todo:
            new_spans = [spans[i] for i in todo]
            new_blocks = [block_ids[i] for i in todo]
            slots = self._span_slots(group_key, new_blocks, new_spans)
            pages.write("sa", slots, kv_rows(sa_k[:, :, verified_rows], sa_v[:, :, verified_rows]))
            layer_kv = self._read_layer_kv(runner, new_blocks, new_spans)
            memory = drafter.encode_memory(layer_kv.to(self._dtype))  # [N, E]
            mem_positions = torch.cat([torch.arange(a, b) for a, b in new_spans])
            k, v = drafter.memory_kv(memory[None], upload(mem_positions, self.device))
            pages.write("memory", slots, kv_rows(k, v))
            for i in todo:
                states[i].written = spans[i][1]
        return sa_k[0, :, last_rows].transpose(0, 1), sa_v[0, :, last_rows].transpose(0, 1)

    def _draft(
        self,
        runner: Any,
        states: list[RequestState],
        pending: list[list[int]],
        last_k: torch.Tensor,
        last_v: torch.Tensor,
        steps: int,
    ) -> list[list[int]]:
        """`steps` greedy drafts per request; one host sync, at the end."""
        drafter, target, pages = self.drafter, self.target, self.pages
        assert drafter is not None and target is not None and pages is not None
        sa = drafter.self_attention
        verified = upload([s.written for s in states], self.device)
        # room for this cycle's drafted positions (from host ints: no device sync)
        width = max(s.written for s in states) + steps
        group, block_size = self._page_key(runner)
        slots = slot_grid([s.block_ids[group] for s in states], block_size, width, self.device)
        sa_kv = PaddedKV.from_rows(
            pages.gather("sa", slots).to(self._dtype), sa.self_attn.num_kv_heads, verified
        )
        sa_kv.append(last_k, last_v)  # the last token sees itself
        # A one-token prompt has no verified token yet: an empty memory (its CA output is zero).
        memory = PaddedKV.from_rows(
            pages.gather("memory", slots).to(self._dtype),
            drafter.cross_attention.self_attn.num_kv_heads,
            verified,
        )
        memory_mask = memory.mask  # fixed for the whole draft (memory rows never grow in it)
        tail = self._tail_batch(runner, [s.block_ids for s in states], width, verified)
        query = target.embed(upload([p[-1] for p in pending], self.device))
        query = query.to(self._dtype)[:, None]  # [B, 1, E]
        positions = verified[:, None].clone()  # each last token's position
        drafted: list[torch.Tensor] = []
        for step in range(steps):
            if step:  # the previous draft is the next query, and its SA K/V joins the cache
                query = target.embed(drafted[-1]).to(self._dtype)[:, None]
                k, v = sa.kv_from(query, positions)
                sa_kv.append(k[:, :, 0], v[:, :, 0])
            h = sa(query, positions, sa_kv.k, sa_kv.v, sa_kv.mask)
            # Every memory row (< p <= position) is visible to a drafted position.
            h = drafter.cross_attention(h, positions, memory.k, memory.v, memory_mask)[:, 0]
            # TLI=0 predicts the target's final (normalised) output; TLI=N ends with the target's
            # last N layers and final norm.
            if tail:
                h = self._run_tail(tail, h, positions[:, 0])
            drafted.append(target.logits(h.to(self._target_dtype)).argmax(dim=-1))
            positions = positions + 1
        chains: list[list[int]] = torch.stack(drafted, dim=1).tolist()
        return chains

    @property
    def _target_dtype(self) -> torch.dtype:
        return self.vllm_config.model_config.dtype

    # -- TLI ---------------------------------------------------------------------------------------

    def _tail_batch(
        self, runner: Any, block_ids: list[Any], width: int, verified: torch.Tensor
    ) -> list[PaddedKV]:
        """Per tail layer, the verified prefix's K/V read from the target's own paged cache (whole
        blocks), with room for this cycle's drafted positions (which never touch the target's
        cache): [B, Hkv, width, D] each."""
        assert self.drafter is not None and self.target is not None
        tli = self.drafter.config.tli
        if not tli:
            return []
        attns = self.target.attn_layers[-tli:]
        keys = self._groups(runner, [a.layer_name for a in attns])
        tables = {
            (group, size): upload(
                block_table([ids[group] for ids in block_ids], size, width), self.device
            )
            for group, size in set(keys)
        }
        out = []
        for attn, key in zip(attns, keys, strict=True):
            k, v = self._gather_blocks(attn, tables[key])  # [B, S, Hkv, D]
            k = k[:, :width].transpose(1, 2).to(self._target_dtype)
            v = v[:, :width].transpose(1, 2).to(self._target_dtype)
            out.append(PaddedKV(k, v, verified.clone()))
        return out

    def _run_tail(
        self, tail: list[PaddedKV], hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Run the target's last layers on drafted hidden [B, E] at positions [B]; their K/V
        are appended to `tail` (this cycle only) so later drafted positions see them."""
        assert self.target is not None
        total = self.target.shape.num_layers
        h = hidden.to(self._target_dtype)
        for kv, index in zip(tail, range(total - len(tail), total), strict=True):
            q, k, v = self.target.tail_qkv(index, h, positions)  # [B, H, D], [B, Hkv, D]
            kv.append(k, v)
            mask = kv.visible(positions, self.target.window(index))
            h = self.target.tail_finish(index, h, q, kv.k, kv.v, mask)
        return self.target.final_norm(h)
