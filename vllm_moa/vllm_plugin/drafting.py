"""MoA's drafting inside vLLM, for both of vLLM's model runners: one core, fed typed views.

`MoADraftCore` owns what drafting needs (the drafter, the target view, the drafter's page stores,
the compiled step) and does the two things a step asks of it, reading nothing of vLLM's runner,
clock or environment:

- `write_rows(PageRows)`: the page rows (CA memory K/V through LSA, and SA K/V) of verified
  tokens, from the target's K/V of every layer at their slots;
- `draft(DraftInputs)`: K greedy draft steps for a batch of requests, each from its last token,
  on the pages in place (and for TLI through the target's own last layers), returned as a device
  tensor [B, K]: no host synchronisation. With a draft vocabulary (`vocab`, draft_vocab.py) the
  drafts are its tokens only.

The adapters (proposer.py for V1, speculator.py for V2) turn a runner's step into these views.
`CacheLayout` says which KV-cache group (and block size) holds each layer and carries the
target's attention groups (vLLM's metadata builders, for TLI): it is bound once, when vLLM has
built its KV caches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.model.config import TargetShape
from vllm_moa.vllm_plugin.compiled import Compiled
from vllm_moa.vllm_plugin.draft_vocab import DraftVocabHead
from vllm_moa.vllm_plugin.kv_reader import CpuBlockLayout, gather_layer_kv
from vllm_moa.vllm_plugin.logs import LOGGER_NAME
from vllm_moa.vllm_plugin.paged_attention import PagedKV, bind_stores, draft_slots
from vllm_moa.vllm_plugin.pages import DrafterPages
from vllm_moa.vllm_plugin.tail_attention import StaticTail, TailLayers, tail_step
from vllm_moa.vllm_plugin.target_view import VllmTargetView
from vllm_moa.vllm_plugin.tensor_parallel import gather_kv_heads

logger = logging.getLogger(LOGGER_NAME)

# Debugging and tests: append one JSON line {"tokens": [...], "drafts": [...]} per drafted request
# (a request's tokens up to its last, and the chain drafted from them), on either runner.
TRACE_ENV = "VLLM_MOA_TRACE"


@dataclass(frozen=True)
class CacheLayout:
    """Where vLLM keeps each layer's KV: `where[layer name] = (KV-cache group, block size)`, and
    the runner's attention groups per KV-cache group (`attn_groups[g]`: vLLM's AttentionGroup
    objects, whose metadata builders the TLI layers use)."""

    where: dict[str, tuple[int, int]]
    attn_groups: list[list[Any]]

    @classmethod
    def of(cls, kv_cache_config: Any, attn_groups: list[list[Any]]) -> CacheLayout:
        where = {}
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                where[name] = (g, int(group.kv_cache_spec.block_size))
        return cls(where, attn_groups)


@dataclass(frozen=True)
class PageRows:
    """Verified tokens whose page rows to write (flat, N rows, on the device)."""

    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slots: dict[int, torch.Tensor]  # per KV-cache group: the rows' slots [N] (PADDING_SLOT: skip)


@dataclass(frozen=True)
class DraftInputs:
    """A batch of B requests to draft for (device tensors, one row per request)."""

    tokens: torch.Tensor  # [B]: each request's last token (no target K/V yet)
    positions: torch.Tensor  # [B] int64: its position = the request's verified tokens
    ends: torch.Tensor  # [B]: first position past the request's budget (no slot written there)
    block_tables: dict[int, torch.Tensor]  # per KV-cache group: int32 [B, n]
    max_seq_len: int  # a host bound on positions + 1 (TLI's attention metadata)
    steps: int  # draft steps (chain length)


class MoADraftCore:
    def __init__(
        self,
        drafter: MoADrafter,
        target: VllmTargetView,
        vllm_config: Any,
        device: torch.device,
        tp: int = 1,
        vocab: DraftVocabHead | None = None,
    ) -> None:
        """`vocab`: the drafter's draft vocabulary's head (draft_vocab.py), None for drafts
        over the whole vocabulary."""
        self.drafter, self.target, self.device, self.tp = drafter, target, device, tp
        self.vocab = vocab
        self.vllm_config = vllm_config
        self.target_dtype: torch.dtype = vllm_config.model_config.dtype
        self.backend: str = target.attn_layers[0].attn_backend.get_name()
        sa, ca = drafter.self_attention.self_attn, drafter.cross_attention.self_attn
        self.pages = DrafterPages(
            {"memory": (ca.num_kv_heads, ca.head_dim), "sa": (sa.num_kv_heads, sa.head_dim)},
            like=target.attn_layers[0],
            vllm_config=vllm_config,
        )
        self.layout: CacheLayout | None = None  # set once vLLM has planned the KV caches
        self._group_cache: tuple[tuple[int, int], list[tuple[int, int]], dict[int, str]] | None = (
            None
        )
        self.stores: dict[str, PagedKV] | None = None
        self._tail: TailLayers | None = None
        self._cpu_layouts: dict[tuple[Any, ...], CpuBlockLayout] = {}
        self._draft_step: Callable[..., torch.Tensor] = paged_draft_step
        self._page_rows: Callable[..., tuple[torch.Tensor, ...]] = page_rows

    # -- start-up ------------------------------------------------------------------------------

    def compile(self, block_size: int, steps: int) -> None:
        """Compile the draft step and the page-row function and warm both up on stand-in pages
        (`warm_up`), so that no request waits for a compile."""
        began = time.perf_counter()
        step, rows = Compiled(paged_draft_step), Compiled(page_rows)
        warm_up(
            self.drafter, self.target.shape, self.pages, self.backend, self.device,
            self.target_dtype, block_size, steps, step.warm, rows.warm,
        )  # fmt: skip
        self._draft_step, self._page_rows = step, rows
        logger.info("MoA drafter compiled in %.1f s", time.perf_counter() - began)

    def ready(self) -> bool:
        """Whether the core can run: its layout is set (`layout`, once vLLM has planned the KV
        caches) and vLLM has bound every cache it reads (not yet during vLLM's profiling run);
        builds the page stores the first time."""
        if self.stores is not None:
            return True
        if self.layout is None or not self.bound:
            return False
        drafter = self.drafter
        self.stores = {
            name: self.pages.store(name, drafter.dtype, self.backend) for name in self.pages.fields
        }
        logger.info(
            "MoA drafter pages: %s",
            ", ".join(f"{n} {type(s).__name__}" for n, s in self.stores.items()),
        )
        return True

    @property
    def bound(self) -> bool:
        """Whether vLLM has bound the KV caches of the target's layers and of the pages."""
        return self.pages.bound and all(
            a.kv_cache is not None and a.kv_cache.numel() > 0 for a in self.target.attn_layers
        )

    def group_of(self, name: str) -> tuple[int, int]:
        assert self.layout is not None
        return self.layout.where[name]

    @property
    def page_group(self) -> tuple[int, int]:
        """(KV-cache group, block size) of the page layers: all in one group."""
        return self._groups()[0]

    @property
    def groups(self) -> list[tuple[int, int]]:
        """Every KV-cache group the core reads or writes (target layers and pages), in order."""
        return self._groups()[1]

    @property
    def group_layer(self) -> dict[int, str]:
        """A layer of each KV-cache group the core touches (whose slot mapping is the group's)."""
        return self._groups()[2]

    def _groups(self) -> tuple[tuple[int, int], list[tuple[int, int]], dict[int, str]]:
        """(page group, every group, a layer of each), worked out once from the layout (the hot
        path asks every step)."""
        if self._group_cache is None:
            (page,) = {self.group_of(name) for name in self.pages.layer_names}
            names = self.target.layer_names + self.pages.layer_names
            first: dict[int, str] = {}
            for name in names:
                first.setdefault(self.group_of(name)[0], name)
            groups = sorted({self.group_of(name) for name in names})
            self._group_cache = (page, groups, first)
        return self._group_cache

    @property
    def tail_layers(self) -> TailLayers:
        """The TLI layers (the target's last `tli`) by KV-cache group, with their builders
        (worked out once from the layout: eager TLI drafting asks every step)."""
        layout = self.layout
        assert layout is not None
        if self._tail is None or self._tail.attn_groups is not layout.attn_groups:
            tli = self.drafter.config.tli
            names = self.target.layer_names[self.target.shape.num_layers - tli :] if tli else []
            groups: dict[int, tuple[int, list[str]]] = {}
            for name in names:
                group, block_size = self.group_of(name)
                groups.setdefault(group, (block_size, []))[1].append(name)
            self._tail = TailLayers(groups, layout.attn_groups)
        return self._tail

    # -- page rows -----------------------------------------------------------------------------

    def write_rows(self, rows: PageRows) -> None:
        """Memory and SA rows of `rows` (verified tokens: their target K/V are in the cache)."""
        drafter, stores = self.drafter, self.stores
        assert stores is not None
        if rows.token_ids.shape[0] == 0:
            return
        layer_kv = self.read_layer_kv(rows.slots).to(drafter.dtype)
        embeds = self.target.embed(rows.token_ids).to(drafter.dtype)
        sa_k, sa_v, memory_k, memory_v = self._page_rows(drafter, embeds, layer_kv, rows.positions)
        slots = rows.slots[self.page_group[0]]
        stores["sa"].write(sa_k, sa_v, slots)
        stores["memory"].write(memory_k, memory_v, slots)

    def read_layer_kv(self, slots: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target K|V rows [N, L, 2 * E_kv] (per layer [k_h0|v_h0|...]) at each group's slots.
        A padding slot reads block 0's first row (vLLM's null block): rows nobody uses."""
        attns = self.target.attn_layers
        keys = [self.group_of(name) for name in self.target.layer_names]
        out: list[torch.Tensor | None] = [None] * len(attns)
        for key in dict.fromkeys(keys):  # each KV-cache group once, in order
            members = [i for i, k in enumerate(keys) if k == key]
            got = gather_layer_kv(
                [attns[i].kv_cache for i in members],
                slots[key[0]].clamp(min=0),
                *self._cache_layout(attns[members[0]]),
            )
            if self.tp > 1:  # this rank holds its share of the KV heads: all of them
                got = gather_kv_heads(got, self.target.shape.num_kv_heads, self.tp)
            if len(members) == len(attns):
                return got
            for j, i in enumerate(members):
                out[i] = got[:, j]
        return torch.stack(out, dim=1)  # type: ignore[arg-type]

    def _cache_layout(self, attn: Any) -> tuple[str, CpuBlockLayout | None]:
        """The layer's backend name and, for CPU_ATTN, its probed in-block layout (cached)."""
        backend = attn.attn_backend.get_name()
        cache = attn.kv_cache
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

    # -- drafting ------------------------------------------------------------------------------

    def draft(self, inputs: DraftInputs, tail: StaticTail | None = None) -> torch.Tensor:
        """`inputs.steps` greedy drafts per request: int64 [B, steps] on the device. `tail`:
        the TLI layers' metadata over persistent buffers (a captured loop, draft_graphs.py);
        None builds it on the host each step."""
        drafter, target, stores = self.drafter, self.target, self.stores
        assert stores is not None
        group, block_size = self.page_group
        table = widen(inputs.block_tables[group], 2)  # width 1 would compile graphs of its own
        tli = drafter.config.tli
        positions, tokens = inputs.positions, inputs.tokens
        memory_lens = positions.clamp(min=1).to(torch.int32)
        # A one-token prompt has no verified token yet: an empty memory (its CA output is zero).
        has_memory = (positions > 0).long()[:, None, None]
        bind_stores(stores)  # the pages the compiled step's attention ops act on
        drafted: list[torch.Tensor] = []
        for step in range(inputs.steps):
            # The embedding runs outside the compiled step: with tensor parallelism it is an
            # all-reduce over the vocabulary shards.
            h = self._draft_step(
                drafter, stores, table, block_size, target.embed(tokens), positions,
                inputs.ends, memory_lens, has_memory,
            )  # fmt: skip
            # TLI=0 predicts the target's final (normalised) output; TLI=N ends with the target's
            # last N layers and final norm.
            if tli:
                at = (
                    tail.refresh(positions, inputs.ends)
                    if tail is not None
                    else tail_step(
                        self.tail_layers, positions, inputs.ends, inputs.block_tables,
                        inputs.max_seq_len + step,
                    )
                )  # fmt: skip
                h = target.run_tail(
                    tli, h.to(self.target_dtype), positions, at.metadata, at.slot_mapping,
                    self.vllm_config,
                )  # fmt: skip
            tokens = self._greedy(h.to(self.target_dtype))
            drafted.append(tokens)
            positions = positions + 1
        return torch.stack(drafted, dim=1)

    def _greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, E] -> the greedy drafts [B]: the argmax of the target's
        logits, over the draft vocabulary when the drafter has one."""
        if self.vocab is None:
            return self.target.logits(h).argmax(dim=-1)
        return self.vocab.argmax(h, self.target.logits)


def warm_up(
    drafter: MoADrafter,
    shape: TargetShape,
    pages: DrafterPages,
    backend: str,
    device: torch.device,
    target_dtype: torch.dtype,
    block_size: int,
    steps: int,
    step: Callable[..., torch.Tensor],
    rows: Callable[..., tuple[torch.Tensor, ...]],
) -> None:
    """Run `step` (a draft step) and `rows` (the page-row function) on stand-in pages, for one
    row and for several: under torch.compile with dynamic shapes, every batch then reuses these
    graphs (one row keeps graphs of its own, as PyTorch specialises size 1; padding it to two
    rows instead costs more than it saves, e.g. oneDNN's GEMMs are slower for 2 rows than 1).
    Every tensor is made on `device`, the stand-ins are of the store class serving uses
    (`backend`) and made outside inference mode, as vLLM makes its caches: traced code that
    reads a store's tensors guards on their device and dispatch keys."""
    stores = {
        name: pages.stand_in(name, drafter.dtype, backend, 8, block_size, device)
        for name in pages.fields
    }
    bind_stores(stores)
    with torch.inference_mode():
        for n in (3, 1):
            positions = torch.arange(5, 5 + 7 * n, 7, device=device)
            table = torch.arange(2, 2 + 2 * n, dtype=torch.int32, device=device).view(n, 2)
            step(
                drafter, stores, table, block_size,
                torch.zeros(n, shape.hidden_size, dtype=target_dtype, device=device),
                positions, positions + steps, positions.to(torch.int32),
                torch.ones(n, 1, 1, dtype=torch.long, device=device),
            )  # fmt: skip
            layer_kv = torch.zeros(
                n, shape.num_layers, 2 * shape.num_kv_heads * shape.head_dim,
                dtype=drafter.dtype, device=device,
            )  # fmt: skip
            embeds = torch.zeros(n, shape.hidden_size, dtype=drafter.dtype, device=device)
            rows(drafter, embeds, layer_kv, positions)


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
