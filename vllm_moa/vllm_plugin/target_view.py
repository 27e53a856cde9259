"""What the MoA proposer uses of vLLM's live target model: embeddings, LM head, attention layers
(for their paged KV) and, for TLI, the last decoder layers run on drafted positions.

Nothing is copied: the embedding table, LM head and tail layers are the target's own modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_moa.model.config import TargetShape
from vllm_moa.model.rope import config_rope_scaling


class VllmTargetView:
    def __init__(self, model: nn.Module, hf_config: Any) -> None:
        self.model = model
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(model, "compute_logits"):
            raise ValueError(
                f"MoA needs a decoder-only target with model.layers and compute_logits; "
                f"{type(model).__name__} has not"
            )
        self.inner = inner
        self.layers = list(layers)
        self.attn_layers = []
        for i, layer in enumerate(self.layers):
            attn = getattr(getattr(layer, "self_attn", None), "attn", None)
            if attn is None or not hasattr(attn, "layer_name"):
                raise ValueError(
                    f"MoA: target layer {i} ({type(layer).__name__}) has no standard attention "
                    "(self_attn.attn); MLA, linear-attention and hybrid targets are not supported."
                )
            self.attn_layers.append(attn)
        heads = hf_config.num_attention_heads
        self.shape = TargetShape(
            num_layers=len(self.layers),
            hidden_size=hf_config.hidden_size,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            vocab_size=hf_config.vocab_size,
            rope_scaling=config_rope_scaling(hf_config),
        )

    @property
    def layer_names(self) -> list[str]:
        return [a.layer_name for a in self.attn_layers]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = getattr(self.model, "embed_input_ids", None) or self.inner.embed_tokens
        return embed(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normalised hidden [N, E] -> logits [N, V] through the target's LM head."""
        compute_logits: Any = self.model.compute_logits
        return compute_logits(hidden)

    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The LM head's rows of `token_ids` (int64 [n]) [n, E], copied, in the dtype
        compute_logits multiplies in, when the argmax of `hidden @ rows.T` is the argmax of
        compute_logits' columns `token_ids` on an unsharded head (the caller checks tensor
        parallelism): the head is one unquantized, bias-free weight, and the logits processor
        reads the head (not logits given as input) and scales by a positive factor; it may also
        soft-cap (tanh). Both are strictly increasing, so the order of the head's raw outputs is
        that of the logits. None otherwise (a quantized head, a bias, another processing): the
        caller takes compute_logits' columns instead."""
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        head: Any = getattr(self.model, "lm_head", None)
        processor: Any = getattr(self.model, "logits_processor", None)
        weight = getattr(head, "weight", None)
        if (
            processor is None
            or not isinstance(getattr(head, "quant_method", None), UnquantizedEmbeddingMethod)
            or getattr(head, "bias", None) is not None
            or not isinstance(weight, torch.Tensor)
            or weight.dim() != 2
            or weight.shape[1] != self.shape.hidden_size
            or weight.shape[0] < self.shape.vocab_size  # rows past V: vLLM's padding
            or getattr(processor, "logits_as_input", False)
            or not float(getattr(processor, "scale", 1.0)) > 0
        ):
            return None
        dtype = getattr(processor, "head_dtype", None) or weight.dtype
        return weight.detach()[token_ids.to(weight.device)].to(dtype)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.norm(hidden)

    # TLI ------------------------------------------------------------------------------------

    def run_tail(
        self,
        num_layers: int,
        hidden: torch.Tensor,  # [B, E]: one drafted position per row
        positions: torch.Tensor,  # [B]
        attn_metadata: dict[str, Any],
        slot_mapping: dict[str, torch.Tensor],
        vllm_config: Any,
    ) -> torch.Tensor:
        """The target's own last `num_layers` decoder layers and final norm on drafted rows,
        exactly as vLLM runs them (any architecture it serves: q/k norms, sliding windows, ...).
        Their attention reads the target's paged cache through `attn_metadata` (per layer name)
        and first writes the rows' K/V at `slot_mapping` (the scheduler's lookahead slots)."""
        from vllm.forward_context import set_forward_context

        residual: torch.Tensor | None = None
        with set_forward_context(
            attn_metadata, vllm_config, num_tokens=hidden.shape[0], slot_mapping=slot_mapping
        ):
            for layer in self.layers[len(self.layers) - num_layers :]:
                hidden, residual = layer(positions, hidden, residual)
        out, _ = self.inner.norm(hidden, residual)
        return out
