"""The Mixture of Attentions drafter: LSA + mean + Ekv2E builds the memory, SA + CA draft.

The module holds only the drafter's own weights. The target's token embeddings, LM head and (for
TLI > 0) its last layers are used through the target adapter, never copied here; see
`vllm_moa.drafters.moa.proposer` for incremental inference. With a draft vocabulary
(config.draft_vocab_size) it also holds the draft tokens' ids, `draft_ids`: the drafts' logits
are the target's LM head's at those rows only, -inf elsewhere (an inference-time restriction:
training is unchanged).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from vllm_moa.drafters.draft_vocab import (
    DraftVocab,
    check_draft_vocab,
    check_loaded_draft_vocab,
    frequent_tokens,
)
from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.drafters.token_layers import random_init
from vllm_moa.model.layers import Attend, DecoderBlock
from vllm_moa.model.masks import causal_mask, memory_mask


class MoADrafter(nn.Module):
    # Submodule names follow the authors' release so its checkpoints map one to one.
    def __init__(self, config: MoAConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        width, hidden = c.lsa_width, c.target_hidden_size
        self.uses_lsa = c.memory_source == "lsa"
        if self.uses_lsa:
            self.layer_self_attention = DecoderBlock(
                width,
                c.lsa_num_heads,
                c.lsa_num_kv_heads,
                c.lsa_intermediate_size,
                c.lsa_rope_theta,
                c.lsa_rms_norm_eps or c.rms_norm_eps,
                over_layers=True,
            )
            self.Ekv2E = nn.Linear(width, hidden, bias=True)
        self.self_attention = DecoderBlock(
            hidden,
            c.sa_num_heads,
            c.sa_num_kv_heads,
            c.sa_intermediate_size,
            c.rope_theta,
            c.rms_norm_eps,
            rope_scaling=c.sa_rope_scaling,  # SA only, as the authors' training code
        )
        self.cross_attention = DecoderBlock(
            hidden,
            c.ca_num_heads,
            c.ca_num_kv_heads,
            c.ca_intermediate_size,
            c.rope_theta,
            c.rms_norm_eps,
        )
        # int64 [draft_vocab_size]: the draft tokens' target ids, strictly ascending, saved with
        # the weights; None (not saved) for the whole vocabulary. A new drafter starts with the
        # first draft_vocab_size ids; `choose_draft_vocab` installs the real ones.
        self.draft_ids: torch.Tensor | None
        self.register_buffer("draft_ids", _first_ids(c))
        self.register_load_state_dict_post_hook(_check_loaded_vocab)

    @property
    def dtype(self) -> torch.dtype:
        return self.cross_attention.dtype

    def choose_draft_vocab(self, trained: Iterable[Sequence[int]]) -> DraftVocab | None:
        """Set the draft vocabulary from the training data's trained tokens (each example's;
        `draft_vocab.frequent_tokens`, as EAGLE-3's), returned; None when the drafter drafts
        over the whole vocabulary (nothing to choose)."""
        if not self.config.reduced_vocab:
            return None
        assert self.config.draft_vocab_size is not None
        vocab = frequent_tokens(trained, self.config.vocab_size, self.config.draft_vocab_size)
        self.set_draft_vocab(vocab.token_ids)
        return vocab

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Install the draft vocabulary: `token_ids` int [draft_vocab_size], the target ids of
        the draft tokens, strictly ascending."""
        if self.draft_ids is None:
            raise ValueError(
                f"this MoA drafter drafts over the whole vocabulary (draft_vocab_size "
                f"{self.config.draft_vocab_size}): it has no draft vocabulary to set; give it one "
                "first (`set_draft_vocab_size`, or `vllm-moa train --draft-vocab N`)"
            )
        ids = token_ids.to(device=self.draft_ids.device, dtype=torch.long)
        check_draft_vocab(ids, self.draft_ids.shape[0], self.config.vocab_size)
        with torch.no_grad():
            self.draft_ids.copy_(ids)

    def set_draft_vocab_size(self, n: int | None) -> None:
        """Draft over n tokens from now on (the first n ids until `choose_draft_vocab` picks
        them), or over the whole vocabulary for None: the draft vocabulary is an inference-time
        choice for MoA (no weights depend on it), so a trained drafter can take a new one
        (`vllm-moa train --drafter D --draft-vocab N`)."""
        config = dataclasses.replace(self.config, draft_vocab_size=n)  # validates n
        device = next(self.parameters()).device
        self.config = config
        self.draft_ids = _first_ids(config, device)

    def init_weights(self, seed: int, std: float = 0.02, norm_init: str = "ones") -> None:
        """Deterministic random initialisation (normal(0, std) matrices, zero bias, norms of
        ones or normal(0, std): `random_init`)."""
        random_init(self, seed, std, norm_init)

    def encode_memory(self, features: torch.Tensor) -> torch.Tensor:
        """Memory rows [N, E] from per-token target features.

        memory_source "lsa": features are [N, L, 2*E_kv], the post-RoPE K|V of every target
        layer per token (tokens independent): LSA over the layer axis, mean, Ekv2E.
        memory_source "hidden": features are the target's final hidden states [N, E], used as is.
        """
        if not self.uses_lsa:
            return features
        layer_kv = features
        lsa = self.layer_self_attention
        layers = torch.arange(layer_kv.shape[1], device=layer_kv.device)
        k, v = lsa.kv_from(layer_kv, layers)
        h = lsa(layer_kv, layers, k, v, None)  # full (non-causal) mask over layers
        return self.Ekv2E(h.mean(dim=1))

    def memory_kv(
        self, memory: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """memory: [B, S, E] at token positions [S] -> CA keys/values [B, Hkv, S, D]."""
        return self.cross_attention.kv_from(memory, positions)

    def draft_step(
        self,
        token_embeds: torch.Tensor,  # [N, E]: one drafted position per row
        positions: torch.Tensor,  # [N]
        self_attend: Attend,
        cross_attend: Attend,
    ) -> torch.Tensor:
        """The drafting step every inference path runs (standalone chains and trees, vLLM):
        SA then CA on one position per row, predicting o^(L+1-TLI) [N, E] (TLI's target layers
        and the LM head follow in the caller). The callers own the keys: `self_attend(q, k, v)`
        gets the queries [N, H, D] and the rows' own SA K/V [N, Hkv, D] (to store, then attend
        over the SA history and themselves); `cross_attend(q, None, None)` attends over the
        memory rows visible to the row. Dense, tree-masked or paged: the math is this one."""
        h = self.self_attention.step(token_embeds, positions, self_attend)
        return self.cross_attention.step(h, positions, cross_attend, self_kv=False)

    def forward(
        self,
        token_embeds: torch.Tensor,  # [B, T, E] target embeddings of tokens 0..T-1
        features: torch.Tensor,  # [B, T, L, 2*E_kv] K|V ("lsa") or [B, T, E] hidden ("hidden")
        memory_limit: torch.Tensor,  # [T] or [B, T]: query t sees memory rows < limit
        sa_from: torch.Tensor | None = None,  # [B, T]: SA query t sees keys >= sa_from
    ) -> torch.Tensor:
        """Full-sequence forward: predicted o^(L+1-TLI) at every position, [B, T, E].

        Used for training and as the reference the incremental proposer must reproduce.
        `sa_from` restricts SA to a window (the release's early-training "staircase").
        """
        bsz, seq = token_embeds.shape[:2]
        positions = torch.arange(seq, device=token_embeds.device)
        memory = self.encode_memory(features.flatten(0, 1)).unflatten(0, (bsz, seq))
        sa_k, sa_v = self.self_attention.kv_from(token_embeds, positions)
        sa_mask = causal_mask(positions, seq)
        if sa_from is not None:
            sa_mask = (sa_mask & (positions[None, None, :] >= sa_from[:, :, None]))[:, None]
        h = self.self_attention(token_embeds, positions, sa_k, sa_v, sa_mask)
        mem_k, mem_v = self.memory_kv(memory, positions)
        mask = memory_mask(memory_limit.reshape(-1), seq).view(-1, 1, seq, seq)
        return self.cross_attention(h, positions, mem_k, mem_v, mask)


def _first_ids(config: MoAConfig, device: torch.device | None = None) -> torch.Tensor | None:
    """The placeholder draft vocabulary of a drafter of `config` (its first draft_vocab_size
    ids), None for the whole vocabulary."""
    if not config.reduced_vocab:
        return None
    assert config.draft_vocab_size is not None
    return torch.arange(config.draft_vocab_size, device=device)


def _check_loaded_vocab(module: nn.Module, incompatible: object) -> None:
    """After load_state_dict: the draft ids must ascend within the target's vocabulary."""
    assert isinstance(module, MoADrafter)
    if module.draft_ids is None:
        return
    ids = module.draft_ids
    check_loaded_draft_vocab("draft_ids", ids, ids.shape[0], module.config.vocab_size)
