"""What the MoA proposer uses of vLLM's live target model: embeddings, LM head, attention layers
(for their paged KV) and, for TLI, the last decoder layers run on drafted positions.

Nothing is copied: the embedding table, LM head and tail layers are the target's own modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_moa.model.config import TargetShape


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

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.norm(hidden)

    # TLI ------------------------------------------------------------------------------------

    def check_tail(self, num_layers: int) -> None:
        for layer in self.layers[len(self.layers) - num_layers :]:
            attn = layer.self_attn
            if hasattr(attn, "q_norm") or not all(
                hasattr(attn, a) for a in ("qkv_proj", "o_proj", "rotary_emb", "q_size")
            ):
                raise ValueError(
                    "MoA TLI > 0 runs the target's last layers itself and supports Llama-style "
                    f"layers only (fused qkv_proj, no q/k norm); {type(layer).__name__} is not. "
                    "Use a drafter trained with --tli 0."
                )

    def window(self, index: int) -> int | None:
        """Layer `index`'s sliding window (a query sees the last `window` positions, itself
        included, as in Hugging Face and vLLM's backends), or None for full attention."""
        return getattr(self.attn_layers[index], "sliding_window", None) or None

    def tail_qkv(
        self, index: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `index` on hidden [N, E] at positions [N]: q [N, H, D], k, v [N, Hkv, D]."""
        attn = self.layers[index].self_attn
        x = self.layers[index].input_layernorm(hidden)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        d = self.shape.head_dim
        return q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d)), v.unflatten(-1, (-1, d))

    def tail_finish(
        self,
        index: int,
        hidden: torch.Tensor,  # [B, E] residual input of the layer
        attn_out: torch.Tensor,  # [B, H, D]: the layer's attention output per head
    ) -> torch.Tensor:
        layer = self.layers[index]
        h = hidden + layer.self_attn.o_proj(attn_out.flatten(1).to(hidden.dtype))[0]
        return h + layer.mlp(layer.post_attention_layernorm(h))
