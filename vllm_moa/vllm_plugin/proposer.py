"""The MoA proposer inside vLLM's V1 model runner: chain drafts for every running request at once.

Per request it keeps (keyed by request id, dropped when the request leaves the runner):
- the CA memory K/V for tokens 0..p-1, where p = tokens whose target K/V is in the paged cache
  (all but the token just sampled). New rows are read from the target's paged KV cache of every
  layer (by block table), go through LSA + mean + Ekv2E once, and are appended;
- the SA K/V of a prefix of the token sequence (SA K/V of a position depends only on its token,
  so a prefix stays valid as long as its tokens do; rejected drafts are cut off).

Each step drafts K tokens greedily from the last sampled token, exactly as the standalone engine's
`MoAProposer` does (a test checks they agree token for token): SA over the pending tokens, CA
over the memory, TLI through the target's own last layers (their K/V for drafted positions stay
in the proposer; the verified cache is only read), the target's LM head. Greedy drafts keep
vLLM's rejection sampler lossless at any temperature (it treats the draft as a point mass).

Chunked prefill, preemption and recomputation need no special case: the memory is extended
lazily to whatever the paged cache holds when a request next needs drafts, and a request that
comes back with fewer verified tokens than its memory starts over.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_moa.checkpoint.io import load_drafter
from vllm_moa.model.moa import MoADrafter
from vllm_moa.vllm_plugin.kv_reader import (
    CpuBlockLayout,
    check_backend,
    gather_kv,
    slots_for_positions,
)
from vllm_moa.vllm_plugin.target_view import VllmTargetView

logger = logging.getLogger("vllm_moa")

# Debugging and tests: append one JSON line {"tokens": [...], "drafts": [...]} per drafted request.
TRACE_ENV = "VLLM_MOA_TRACE"


@dataclass
class RequestState:
    mem_tokens: list[int] = field(default_factory=list)  # the tokens the memory rows are of
    mem_k: torch.Tensor | None = None  # [1, Hkv, p, D]
    mem_v: torch.Tensor | None = None
    sa_tokens: list[int] = field(default_factory=list)  # tokens with SA K/V cached, from 0
    sa_k: torch.Tensor | None = None  # [1, Hkv, len(sa_tokens), D]
    sa_v: torch.Tensor | None = None
    # TLI: the verified prefix's K/V of each tail layer (same tokens as the memory), [1, Hkv, n, D]
    tail_k: list[torch.Tensor] = field(default_factory=list)
    tail_v: list[torch.Tensor] = field(default_factory=list)

    @property
    def memory_len(self) -> int:
        return 0 if self.mem_k is None else self.mem_k.shape[2]


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=2)


@dataclass
class PaddedKV:
    """Per-request K/V [1, H, S_i, D] batched as [B, H, S, D] with row lengths, with room to
    append `extra` positions per row (one per draft step) without re-padding."""

    k: torch.Tensor  # [B, H, S, D]
    v: torch.Tensor
    lengths: torch.Tensor  # long [B]

    @classmethod
    def of(cls, ks: list[torch.Tensor], vs: list[torch.Tensor], extra: int = 0) -> PaddedKV:
        lengths = [t.shape[2] for t in ks]
        width = max(1, max(lengths) + extra)  # >= 1: rows with nothing visible attend to zeros
        k = ks[0].new_zeros(len(ks), ks[0].shape[1], width, ks[0].shape[3])
        v = torch.zeros_like(k)
        for i, (ki, vi) in enumerate(zip(ks, vs, strict=True)):
            k[i, :, : ki.shape[2]] = ki[0]
            v[i, :, : vi.shape[2]] = vi[0]
        return cls(k, v, torch.tensor(lengths, device=k.device))

    @property
    def mask(self) -> torch.Tensor:
        """bool [B, 1, 1, S]: key j of row b is visible."""
        cols = torch.arange(self.k.shape[2], device=self.k.device)
        return (cols[None, :] < self.lengths[:, None])[:, None, None, :]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One more position per row: k, v [B, H, D]."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, self.lengths] = k.to(self.k.dtype)
        self.v[rows, :, self.lengths] = v.to(self.v.dtype)
        self.lengths += 1

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(self.lengths[i])
        return self.k[i : i + 1, :, :n].clone(), self.v[i : i + 1, :, :n].clone()


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
        self._layer_groups: list[tuple[int, int]] | None = None  # per target layer: group, block
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
        logger.info(
            "MoA drafter %s loaded: TLI=%d, K=%d, backend %s",
            spec.model,
            drafter.config.tli,
            self.num_speculative_tokens,
            target.attn_layers[0].attn_backend.get_name(),
        )

    def _layer_layout(self, runner: Any) -> list[tuple[int, int]]:
        if self._layer_groups is None:
            assert self.target is not None
            where: dict[str, tuple[int, int]] = {}
            for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
                for name in group.layer_names:
                    where[name] = (g, int(group.kv_cache_spec.block_size))
            self._layer_groups = [where[name] for name in self.target.layer_names]
        return self._layer_groups

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
        if self.drafter is None or self.target is None:
            return drafts
        if any(a.kv_cache is None or a.kv_cache.numel() == 0 for a in self.target.attn_layers):
            return drafts  # profiling run: no cache bound yet
        rows: list[int] = []
        budgets: list[int] = []
        tokens: list[list[int]] = []
        for row, rid in enumerate(req_ids):
            if row >= len(sampled_token_ids) or not sampled_token_ids[row]:
                continue  # partial prefill chunk or discarded: nothing to draft from
            n = int(batch.num_tokens_no_spec[row])
            budget = min(self.num_speculative_tokens, self.max_model_len - n)
            if budget <= 0:
                continue
            seq = batch.token_ids_cpu[row, :n].tolist()
            state = self.states.get(rid)
            if (
                state is None
                or state.memory_len > n - 1
                or seq[: state.memory_len] != state.mem_tokens
            ):  # new, or preempted and recomputed, or a request id reused for another sequence
                self.states[rid] = RequestState()
            rows.append(row)
            budgets.append(budget)
            tokens.append(seq)
        if not rows:
            return drafts
        self._extend_memories(runner, [req_ids[r] for r in rows], tokens)
        chains = self._draft([self.states[req_ids[r]] for r in rows], tokens, max(budgets))
        for row, budget, chain in zip(rows, budgets, chains, strict=True):
            drafts[row] = chain[:budget]
        trace = os.environ.get(TRACE_ENV)
        if trace:
            with open(trace, "a") as f:
                for row, toks in zip(rows, tokens, strict=True):
                    f.write(json.dumps({"tokens": toks, "drafts": drafts[row]}) + "\n")
        return drafts

    def _read_layer_kv(
        self, runner: Any, block_ids: list[tuple[list[int], ...]], spans: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Target K|V rows [N, L, 2 * E_kv] (per layer [k_h0|v_h0|...]) for each request's
        position span, concatenated in request order."""
        assert self.target is not None
        layout = self._layer_layout(runner)
        slots_by_group: dict[tuple[int, int], torch.Tensor] = {}
        per_layer = []
        for attn, key in zip(self.target.attn_layers, layout, strict=True):
            if key not in slots_by_group:
                group, block_size = key
                slots_by_group[key] = torch.cat(
                    [
                        slots_for_positions(ids[group], block_size, a, b, self.device)
                        for ids, (a, b) in zip(block_ids, spans, strict=True)
                    ]
                )
            k, v = self._gather(attn, slots_by_group[key])
            per_layer.append(torch.stack([k, v], dim=2).flatten(1))  # [N, H*2*D]
        return torch.stack(per_layer, dim=1)

    def _gather(self, attn: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        return gather_kv(cache, slots, backend, layout)

    def _extend_memories(self, runner: Any, req_ids: list[str], tokens: list[list[int]]) -> None:
        """Memory rows for every token with target K/V not yet in a request's memory."""
        drafter = self.drafter
        assert drafter is not None
        states = [self.states[r] for r in req_ids]
        spans = [(s.memory_len, len(t) - 1) for s, t in zip(states, tokens, strict=True)]
        todo = [i for i, (a, b) in enumerate(spans) if b > a]
        if not todo:
            return
        layer_kv = self._read_layer_kv(
            runner, [runner.requests[req_ids[i]].block_ids for i in todo], [spans[i] for i in todo]
        )
        memory = drafter.encode_memory(layer_kv.to(self._dtype))  # [N, E]
        tail = self._tail_rows(layer_kv)
        positions = torch.cat([torch.arange(*spans[i]) for i in todo]).to(self.device)
        k, v = drafter.memory_kv(memory[None], positions)  # [1, Hkv, N, D]
        offset = 0
        for i in todo:
            n = spans[i][1] - spans[i][0]
            state = states[i]
            state.mem_k = _cat(state.mem_k, k[:, :, offset : offset + n])
            state.mem_v = _cat(state.mem_v, v[:, :, offset : offset + n])
            state.mem_tokens.extend(tokens[i][spans[i][0] : spans[i][1]])
            for j, (tk, tv) in enumerate(tail):
                rows_k, rows_v = tk[:, :, offset : offset + n], tv[:, :, offset : offset + n]
                if j < len(state.tail_k):
                    state.tail_k[j] = torch.cat([state.tail_k[j], rows_k], dim=2)
                    state.tail_v[j] = torch.cat([state.tail_v[j], rows_v], dim=2)
                else:
                    state.tail_k.append(rows_k)
                    state.tail_v.append(rows_v)
            offset += n

    @property
    def _dtype(self) -> torch.dtype:
        assert self.drafter is not None
        return self.drafter.cross_attention.dtype

    def _sync_sa(self, state: RequestState, tokens: list[int]) -> None:
        """Keep the SA K/V of the longest prefix whose tokens are unchanged (never the last
        token's: it is the first query and is recomputed)."""
        keep = 0
        limit = min(len(state.sa_tokens), len(tokens) - 1)
        while keep < limit and state.sa_tokens[keep] == tokens[keep]:
            keep += 1
        if keep < len(state.sa_tokens):
            del state.sa_tokens[keep:]
            assert state.sa_k is not None and state.sa_v is not None
            state.sa_k = state.sa_k[:, :, :keep]
            state.sa_v = state.sa_v[:, :, :keep]

    def _tail_rows(self, layer_kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """TLI: the tail layers' K, V [1, Hkv, N, D] out of the rows just read for the memory."""
        assert self.drafter is not None and self.target is not None
        shape = self.target.shape
        out = []
        for layer in range(shape.num_layers - self.drafter.config.tli, shape.num_layers):
            kv = layer_kv[:, layer].unflatten(-1, (shape.num_kv_heads, 2, shape.head_dim))
            out.append((kv[:, :, 0].transpose(0, 1)[None], kv[:, :, 1].transpose(0, 1)[None]))
        return out

    def _draft(
        self, states: list[RequestState], tokens: list[list[int]], steps: int
    ) -> list[list[int]]:
        """`steps` greedy drafts per request; one host sync, at the end."""
        drafter, target = self.drafter, self.target
        assert drafter is not None and target is not None
        sa = drafter.self_attention
        # Step 0 feeds each request's pending tokens (after its cached SA prefix) to SA.
        pending_ids: list[int] = []
        pending_pos: list[int] = []
        last_rows: list[int] = []
        for state, seq in zip(states, tokens, strict=True):
            self._sync_sa(state, seq)
            first = len(state.sa_tokens)
            pending_ids.extend(seq[first:])
            pending_pos.extend(range(first, len(seq)))
            last_rows.append(len(pending_ids) - 1)
        emb = target.embed(torch.tensor(pending_ids, device=self.device)).to(self._dtype)
        k, v = sa.kv_from(emb[None], torch.tensor(pending_pos, device=self.device))
        offset = 0
        for state, seq in zip(states, tokens, strict=True):
            n = len(seq) - len(state.sa_tokens)
            state.sa_k = _cat(state.sa_k, k[:, :, offset : offset + n])
            state.sa_v = _cat(state.sa_v, v[:, :, offset : offset + n])
            state.sa_tokens.extend(seq[len(state.sa_tokens) :])
            offset += n
        query = emb[torch.tensor(last_rows, device=self.device)][:, None]  # [B, 1, E]
        sa_kv = PaddedKV.of(
            [s.sa_k for s in states],  # type: ignore[misc]
            [s.sa_v for s in states],  # type: ignore[misc]
            extra=steps - 1,
        )
        # A one-token prompt has no verified token yet: an empty memory (its CA output is zero).
        ca = drafter.cross_attention.self_attn
        empty = torch.zeros(
            1, ca.num_kv_heads, 0, ca.head_dim, dtype=self._dtype, device=self.device
        )
        memory = PaddedKV.of(
            [empty if s.mem_k is None else s.mem_k for s in states],
            [empty if s.mem_v is None else s.mem_v for s in states],
        )
        tail = self._tail_batch(states, steps)
        positions = torch.tensor([len(t) - 1 for t in tokens], device=self.device)[:, None]
        drafted: list[torch.Tensor] = []
        for step in range(steps):
            if step:  # the previous draft is the next query, and its SA K/V joins the cache
                query = target.embed(drafted[-1]).to(self._dtype)[:, None]
                k, v = sa.kv_from(query, positions)
                sa_kv.append(k[:, :, 0], v[:, :, 0])
            h = sa(query, positions, sa_kv.k, sa_kv.v, sa_kv.mask)
            # Every memory row (< p <= position) is visible to a drafted position.
            h = drafter.cross_attention(h, positions, memory.k, memory.v, memory.mask)[:, 0]
            # TLI=0 predicts the target's final (normalised) output; TLI=N ends with the target's
            # last N layers and final norm.
            if tail:
                h = self._run_tail(tail, h, positions[:, 0])
            drafted.append(target.logits(h.to(self._target_dtype)).argmax(dim=-1))
            positions = positions + 1
        chains: list[list[int]] = torch.stack(drafted, dim=1).tolist()
        for i, (state, chain) in enumerate(zip(states, chains, strict=True)):
            state.sa_k, state.sa_v = sa_kv.row(i)
            state.sa_tokens.extend(chain[: steps - 1])  # the last draft was never fed to SA
        return chains

    @property
    def _target_dtype(self) -> torch.dtype:
        return self.vllm_config.model_config.dtype

    # -- TLI ---------------------------------------------------------------------------------------

    def _tail_batch(self, states: list[RequestState], steps: int) -> list[PaddedKV]:
        """Per tail layer, the verified prefix's K/V batched, with room for the drafted ones."""
        assert self.drafter is not None and self.target is not None
        shape = self.target.shape
        empty = torch.zeros(
            1, shape.num_kv_heads, 0, shape.head_dim, dtype=self._target_dtype, device=self.device
        )
        return [
            PaddedKV.of(
                [s.tail_k[j] if s.tail_k else empty for s in states],
                [s.tail_v[j] if s.tail_v else empty for s in states],
                extra=steps,
            )
            for j in range(self.drafter.config.tli)
        ]

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
            h = self.target.tail_finish(index, h, q, kv.k, kv.v, kv.mask)
        return self.target.final_norm(h)
