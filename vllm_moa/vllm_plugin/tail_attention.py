"""What the TLI tail's attention reads for one draft step: the metadata of vLLM's own attention
builders and the slots the tail layers write their K/V at, for one query per request.

Two ways to make it, the same builders and the same values:

- `tail_step`: built on the host for every draft step (eager drafting, both runners);
- `StaticTail`: built once, at CUDA-graph capture, over persistent buffers (`seq_lens`, slots,
  positions, the graph's block-table buffers); each draft step writes the buffers on the device
  and asks each builder to refresh what it derives from them in place
  (`update_draft_decode_metadata`: vLLM's hook for speculators that record their draft decode
  in a graph, capture-safe by its contract). Host values are fixed at capture: the batch is the
  graph's padded size and `max_seq_len` the model's, as vLLM's own speculators capture theirs.
  Backends without the hook (`static_unsupported`) keep TLI eager.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from vllm_moa.vllm_plugin.paged_attention import PADDING_SLOT, draft_slots
from vllm_moa.vllm_plugin.uploads import upload


@dataclass(frozen=True)
class TailLayers:
    """The TLI layers by KV-cache group: `groups[g] = (block size, layer names)`, and the
    runner's attention groups per KV-cache group (vLLM's AttentionGroup, holding the builders)."""

    groups: dict[int, tuple[int, list[str]]]
    attn_groups: list[list[Any]]

    @functools.cached_property
    def builders(self) -> list[tuple[Any, int, list[str]]]:
        """(builder, its KV-cache group, its TLI layers) for each attention group that holds TLI
        layers (worked out once: eager drafting asks every step)."""
        out = []
        for g, (_, names) in sorted(self.groups.items()):
            for attn_group in self.attn_groups[g]:
                members = [n for n in names if n in attn_group.layer_names]
                if members:
                    out.append((attn_group.get_metadata_builder(), g, members))
        return out


@dataclass(frozen=True)
class TailStep:
    """One draft step's attention inputs of the TLI layers, per layer name."""

    metadata: dict[str, Any]  # the layer's backend metadata
    slot_mapping: dict[str, torch.Tensor]  # [B] int64: where the layer writes the rows' K/V


def _build(
    layers: TailLayers,
    positions: torch.Tensor,  # [B] int64: the drafted position of each row
    seq_lens: torch.Tensor,  # [B] int32: positions + 1
    tables: dict[int, torch.Tensor],  # per KV-cache group: [B, n] int32
    slots: dict[int, torch.Tensor],  # per KV-cache group: [B] int64
    max_seq_len: int,  # a host bound on positions + 1
) -> tuple[TailStep, list[tuple[Any, Any]]]:
    """Every attention group's metadata, one query per row over the row's cache up to and
    including `positions`, and the (builder, metadata) pairs built."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    rows = positions.shape[0]
    starts = torch.arange(rows + 1, dtype=torch.int32)
    device_starts = upload(starts, positions.device)  # pinned: no host stall
    commons = {
        g: CommonAttentionMetadata(
            query_start_loc=device_starts,
            query_start_loc_cpu=starts,
            seq_lens=seq_lens,
            num_reqs=rows,
            num_actual_tokens=rows,
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_table_tensor=tables[g],
            slot_mapping=slots[g],
            positions=positions,
        )
        for g in layers.groups
    }
    metadata: dict[str, Any] = {}
    slot_mapping: dict[str, torch.Tensor] = {}
    built = []
    for builder, g, members in layers.builders:
        made = builder.build(0, commons[g])
        built.append((builder, made))
        metadata.update(dict.fromkeys(members, made))
        slot_mapping.update(dict.fromkeys(members, slots[g]))
    return TailStep(metadata, slot_mapping), built


def _slots(
    layers: TailLayers, positions: torch.Tensor, ends: torch.Tensor, tables: dict[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Each KV-cache group's slots [B] of the drafted positions (PADDING_SLOT past a row's end)."""
    return {
        g: draft_slots(positions, ends, tables[g], block_size)
        for g, (block_size, _) in layers.groups.items()
    }


def tail_step(
    layers: TailLayers,
    positions: torch.Tensor,  # [B] int64: the drafted position of each row
    ends: torch.Tensor,  # [B]: each row's first position past its budget
    tables: dict[int, torch.Tensor],  # per KV-cache group: [B, n] int32
    max_seq_len: int,  # a host bound on positions + 1
) -> TailStep:
    """The step's metadata, built on the host now."""
    seq_lens = (positions + 1).to(torch.int32)
    slots = _slots(layers, positions, ends, tables)
    return _build(layers, positions, seq_lens, tables, slots, max_seq_len)[0]


def static_unsupported(layers: TailLayers) -> list[str]:
    """Backends of the TLI layers whose builders cannot refresh draft-decode metadata in place
    (a captured TLI loop needs that); empty when every one can."""
    return sorted(
        {
            type(builder).__name__
            for builder, _, _ in layers.builders
            if not getattr(builder, "supports_draft_decode_metadata_update", False)
        }
    )


class StaticTail:
    """TLI metadata for a padded batch of `rows`, built once over persistent buffers: `refresh`
    rewrites the buffers from a step's positions on the device and has every builder update its
    metadata in place, so a captured graph replays it. `tables`: the graph's persistent
    block-table buffers (views of `rows` rows) per KV-cache group."""

    def __init__(
        self, layers: TailLayers, tables: dict[int, torch.Tensor], max_seq_len: int
    ) -> None:
        some = next(iter(tables.values()))  # [rows, n]
        rows, device = some.shape[0], some.device
        self.layers, self.tables = layers, tables
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = {
            g: torch.full((rows,), PADDING_SLOT, dtype=torch.long, device=device)
            for g in layers.groups
        }
        self.step, self._built = _build(
            layers, self.positions, self.seq_lens, tables, self.slots, max_seq_len
        )

    def refresh(self, positions: torch.Tensor, ends: torch.Tensor) -> TailStep:
        """This step's values into the buffers (device ops only) and the builders' derived
        metadata updated from them; the metadata objects stay the same."""
        self.positions.copy_(positions)
        self.seq_lens.copy_(positions + 1)
        for g, slots in _slots(self.layers, positions, ends, self.tables).items():
            self.slots[g].copy_(slots)
        for builder, metadata in self._built:
            builder.update_draft_decode_metadata(metadata)
        return self.step
