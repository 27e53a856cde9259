"""The EAGLE-3 drafter: `fc` projects three target states into the feature; one decoder layer
whose attention reads [norm(embedding) | norm(feature)]; a final norm and its own LM head, over
the target's vocabulary or EAGLE-3's reduced draft vocabulary (the `d2t` / `t2d` buffers)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn

from vllm_moa.drafters.draft_vocab import (
    DraftVocab,
    check_draft_vocab,
    check_loaded_draft_vocab,
    frequent_tokens,
)
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.eagle3.config import Eagle3Config
from vllm_moa.drafters.token_layers import TokenLayerConfig
from vllm_moa.model.draft_logits import full_vocab_logits
from vllm_moa.model.layers import Attend, Attention, DecoderBlock, RMSNorm


class Eagle3Block(DecoderBlock):
    """EAGLE-3's decoder layer. Its input x is [e | h] (2E): e the token's embedding, h the
    feature (fc's projection of the target's states, or the previous draft step's output). The
    attention reads [input_layernorm(e) | hidden_norm(h)] (q, k and v project 2E -> heads);
    the residual is h itself, un-normalised; the output (E) is before any final norm:

        h' = h + Attn([N_in(e) | N_h(h)]);  out = h' + MLP(N_post(h'))

    as the authors' `LlamaDecoderLayeremb` and vLLM's `LlamaDecoderLayer` of llama_eagle3.py
    (with norm_before_residual false, its default) compute."""

    def __init__(self, config: TokenLayerConfig) -> None:
        c, e = config, config.target_hidden_size
        heads, kv_heads, eps = c.num_heads, c.num_kv_heads, c.rms_norm_eps
        super().__init__(e, heads, kv_heads, c.intermediate_size, c.rope_theta, eps)
        self.hidden_norm = RMSNorm(e, eps)
        self.self_attn = Attention(
            e, heads, kv_heads, c.rope_theta, rope_scaling=c.rope_scaling, in_width=2 * e
        )
        self.width = e

    def _attention_input(self, x: torch.Tensor) -> torch.Tensor:
        e = self.width
        return torch.cat([self.input_layernorm(x[..., :e]), self.hidden_norm(x[..., e:])], -1)

    def kv_from(
        self, source: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """source: [B, S, 2E] -> k, v: [B, Hkv, S, D]."""
        return self.self_attn.project_kv(self._attention_input(source), positions)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, 2E]
        positions: torch.Tensor,  # [T], or [B, T] per row
        k: torch.Tensor,  # [B, Hkv, S, D]
        v: torch.Tensor,  # [B, Hkv, S, D]
        mask: torch.Tensor | None,  # bool [T, S] or [B, 1, T, S]
    ) -> torch.Tensor:
        """-> [B, T, E]."""
        h = x[..., self.width :]
        h = h + self.self_attn(self._attention_input(x), positions, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def step(
        self, x: torch.Tensor, positions: torch.Tensor, attend: Attend, self_kv: bool = True
    ) -> torch.Tensor:
        raise NotImplementedError("EAGLE-3 drafts through Eagle3Block.forward")


class Eagle3Drafter(EagleDrafter):
    """With a reduced draft vocabulary (config.draft_vocab_size < vocab_size) the LM head has
    draft_vocab_size rows, one per draft token, and two buffers, saved with the weights as the
    authors' release and vLLM's `eagle3` loader hold them:

        d2t: int64 [draft_vocab_size], draft id i is target id i + d2t[i] (an offset), the
             target ids strictly ascending;
        t2d: bool [vocab_size], whether a target token is in the draft vocabulary.

    `logits` returns logits over the target's whole vocabulary, -inf outside the draft vocabulary
    (vLLM's `compute_logits` scatter), so every caller drafts target ids unchanged. A new drafter
    starts with the first draft_vocab_size target ids; `set_draft_vocab` installs the real ones
    (`vllm-moa train --draft-vocab`: the most frequent tokens of the training data)."""

    # EAGLE-3 trains through its unrolled passes (the training-time test).
    DETACH_FED: ClassVar[bool] = False

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        self.config: Eagle3Config = config
        e = config.target_hidden_size
        self.norm = RMSNorm(e, config.rms_norm_eps)
        self.lm_head = nn.Linear(e, config.draft_vocab_size, bias=False)
        self.d2t: torch.Tensor | None
        self.t2d: torch.Tensor | None
        if not config.reduced_vocab:
            self.d2t = self.t2d = None
        else:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)
            self.register_load_state_dict_post_hook(_check_loaded_vocab)

    def draft_token_ids(self) -> torch.Tensor:
        """int64 [draft_vocab_size]: the target id of each draft id (ascending); the whole
        vocabulary's ids when it is not reduced."""
        if self.d2t is None:
            return torch.arange(self.config.vocab_size, device=self.lm_head.weight.device)
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def choose_draft_vocab(self, trained: Iterable[Sequence[int]]) -> DraftVocab | None:
        """Set the reduced draft vocabulary from the training data's trained tokens (each
        example's; `draft_vocab.frequent_tokens`), returned; None when the head covers the whole
        vocabulary (nothing to choose)."""
        if not self.config.reduced_vocab:
            return None
        vocab = frequent_tokens(trained, self.config.vocab_size, self.config.draft_vocab_size)
        self.set_draft_vocab(vocab.token_ids)
        return vocab

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Install the draft vocabulary: `token_ids` int [draft_vocab_size], the target ids of
        the draft tokens, strictly ascending (draft id i = the i-th smallest)."""
        if self.d2t is None or self.t2d is None:
            raise ValueError(
                f"this EAGLE-3 drafter's LM head covers the whole vocabulary "
                f"(draft_vocab_size {self.config.draft_vocab_size} = vocab_size): it has no "
                "draft vocabulary to set; build it with a smaller draft_vocab_size"
            )
        ids = token_ids.to(device=self.d2t.device, dtype=torch.long)
        check_draft_vocab(ids, self.config.draft_vocab_size, self.config.vocab_size)
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True

    def init_head_from(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Start the final norm and LM head from the target's (copies; both then train):
        `vllm-moa train --head-init target`; with a reduced draft vocabulary, the rows of the
        draft tokens (set the vocabulary first). The authors' code starts them from random."""
        if lm_head_weight.shape[0] != self.config.vocab_size:
            raise ValueError(
                f"the target's LM head is {tuple(lm_head_weight.shape)}, this drafter's "
                f"vocabulary {self.config.vocab_size}: --head-init target needs the drafter's "
                "target"
            )
        rows = lm_head_weight[self.draft_token_ids().to(lm_head_weight.device)]
        with torch.no_grad():
            self.norm.weight.copy_(norm_weight.to(self.norm.weight.dtype))
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))

    @staticmethod
    def fc_inputs(config: TokenLayerConfig) -> int:
        """fc reads the target's states of the feature layers, concatenated (3 by default)."""
        assert isinstance(config, Eagle3Config)
        return len(config.feature_layers)

    @staticmethod
    def make_layer(config: TokenLayerConfig) -> DecoderBlock:
        return Eagle3Block(config)

    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    def target_features(self, hidden_states: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """fc([s_low | s_mid | s_high]): the inputs of the feature layers, ascending (as vLLM and
        the authors concatenate them), -> [..., T, E]."""
        dtype = self.fc.weight.dtype
        states = [hidden_states[layer].to(dtype) for layer in self.feature_layers()]
        return self.fc(torch.cat(states, dim=-1))

    def fuse(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[e | h], 2E: Eagle3Block normalises each half and keeps h as its residual."""
        return torch.cat([next_embeds, features.to(next_embeds.dtype)], dim=-1)

    def logits(
        self, states: torch.Tensor, target_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """EAGLE-3's own LM head after its final norm (the target's head is not used), [..., V]:
        with a reduced draft vocabulary its draft_vocab_size logits scattered to their target ids,
        -inf elsewhere (vLLM's `Eagle3LlamaForCausalLM.compute_logits`), so the argmax is the
        draft argmax mapped through d2t and softmax gives the other tokens probability 0."""
        draft = self.lm_head(self.norm(states.to(self.fc.weight.dtype)))
        if self.d2t is None:
            return draft
        return full_vocab_logits(draft, self.draft_token_ids(), self.config.vocab_size)


def _check_loaded_vocab(module: nn.Module, incompatible: object) -> None:
    """After load_state_dict: d2t must map draft ids to ascending target ids in range, and t2d
    must mark exactly those (a d2t / t2d pair from another drafter is refused)."""
    assert isinstance(module, Eagle3Drafter) and module.t2d is not None
    config = module.config
    ids = module.draft_token_ids()
    check_loaded_draft_vocab("d2t", ids, config.draft_vocab_size, config.vocab_size)
    marked = torch.zeros_like(module.t2d)
    marked[ids] = True
    if not bool((marked == module.t2d).all()):  # device sync
        raise ValueError(
            f"t2d marks {int(module.t2d.sum())} target tokens, not the {config.draft_vocab_size} "
            "d2t maps draft ids to: the two come from different drafters; re-save the drafter"
        )
