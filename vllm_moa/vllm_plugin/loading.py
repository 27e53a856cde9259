"""Loading MoA's drafter into a vLLM engine, for either model runner: the drafter directory read
and checked against the live target, the drafting core built, compiled where vLLM compiles."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from vllm_moa.checkpoint.io import load_drafter
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.vllm_plugin.compiled import compile_wanted
from vllm_moa.vllm_plugin.cpu_linear import dispatch_linears
from vllm_moa.vllm_plugin.draft_vocab import DraftVocabHead, draft_vocab_head
from vllm_moa.vllm_plugin.drafting import MoADraftCore
from vllm_moa.vllm_plugin.kv_reader import check_backend
from vllm_moa.vllm_plugin.logs import LOGGER_NAME
from vllm_moa.vllm_plugin.target_view import VllmTargetView

logger = logging.getLogger(LOGGER_NAME)

# "0": the drafter's linear layers use torch.nn.functional.linear on the CPU instead of vLLM's
# CPU GEMM dispatch (for comparisons).
CPU_GEMM_ENV = "VLLM_MOA_CPU_GEMM"


def load_core(target_model: torch.nn.Module, vllm_config: Any, tp: int) -> MoADraftCore:
    """The drafter of `vllm_config`'s speculative config, on the target's device and in vLLM's
    dtype, as a drafting core over `target_model` (its page layers declared to vLLM)."""
    spec = vllm_config.speculative_config
    if getattr(vllm_config.model_config, "use_mla", False):
        raise ValueError("MoA needs per-layer K/V: MLA targets are not supported")
    target = VllmTargetView(target_model, vllm_config.model_config.hf_text_config)
    device = next(target_model.parameters()).device
    dtype = vllm_config.model_config.dtype
    drafter = load_drafter(spec.model, target=target.shape, dtype=dtype, device=device)
    if not isinstance(drafter, MoADrafter):
        raise ValueError(f"{spec.model} is not a MoA drafter")
    if not drafter.uses_lsa:
        raise ValueError(
            "this drafter reads the target's last hidden states (memory_source 'hidden', "
            "the -LSA ablation); inside vLLM only LSA drafters (memory_source 'lsa') are "
            "supported"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    for attn in target.attn_layers:
        check_backend(attn.attn_backend.get_name(), str(cache_dtype))
    cpu_gemm = device.type == "cpu" and os.environ.get(CPU_GEMM_ENV, "1") != "0"
    if cpu_gemm:
        dispatch_linears(drafter)  # vLLM's CPU GEMMs, as the target's layers use
    vocab = _draft_vocab(drafter, target, tp, cpu_gemm)
    core = MoADraftCore(drafter.eval(), target, vllm_config, device, tp, vocab)
    compiled = compile_wanted(vllm_config)
    if compiled:
        core.compile(int(vllm_config.cache_config.block_size), int(spec.num_speculative_tokens))
    logger.info(
        "MoA drafter %s loaded: TLI=%d, K=%d, backend %s, %s",
        spec.model,
        drafter.config.tli,
        int(spec.num_speculative_tokens),
        core.backend,
        "compiled" if compiled else "eager",
    )
    return core


def _draft_vocab(
    drafter: MoADrafter, target: VllmTargetView, tp: int, cpu_gemm: bool
) -> DraftVocabHead | None:
    """The head of the drafter's draft vocabulary (its LM-head rows gathered once, here), None
    when it drafts over the whole vocabulary."""
    if drafter.draft_ids is None:
        return None
    vocab = draft_vocab_head(target, drafter.draft_ids, tp, cpu_gemm)
    logger.info(
        "MoA draft vocabulary: %d of %d tokens, %s",
        vocab.token_ids.shape[0],
        target.shape.vocab_size,
        "drafted from their LM-head rows, gathered once"
        if vocab.gathered
        else "drafted from the whole LM head (sharded or quantized: the rows cannot be gathered)",
    )
    return vocab
