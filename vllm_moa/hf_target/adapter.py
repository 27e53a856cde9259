"""Drive a Hugging Face causal LM as a speculative-decoding target (one sequence at a time).

The adapter runs the model's own decoder layers in its own loop, with its own rollback-able KV
cache (`KVCache`, which has the `update()` signature HF attention layers call). That gives what
MoA needs and `model.generate` does not expose: the post-RoPE K|V of every layer for the new
tokens, hidden states at chosen layers, running only the last N layers (TLI) on drafted states,
and cropping the cache back to the accepted length.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import vllm_moa.hf_target.tree_kernel as tree_kernel
from vllm_moa.hf_target.vocab_head import VocabHead
from vllm_moa.model.config import TargetShape
from vllm_moa.model.kv_cache import KVCache
from vllm_moa.model.layers import use_kernels
from vllm_moa.model.packed_linear import pack_linears
from vllm_moa.model.rope import config_rope_scaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_REQUIRED_MODULES = (
    "model.embed_tokens",
    "model.layers",
    "model.norm",
    "model.rotary_emb",
    "lm_head",
)


@dataclass
class TargetOutput:
    """What one target pass over T new tokens returns."""

    logits: torch.Tensor  # [T, V] float32: next-token logits at each new position
    layer_kv: torch.Tensor  # [T, L, 2*E_kv]: per layer [k_h0|v_h0|k_h1|v_h1|...], post-RoPE
    # HF hidden_states indexing: l < L is the input of layer l (o^(l+1) in the paper, pre-norm);
    # l == L is the final, normalised output. Only the requested indices are present.
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # each [T, E]

    def select(self, rows: list[int]) -> TargetOutput:
        """The given rows (e.g. the positions a verification kept)."""
        index = torch.tensor(rows, device=self.logits.device)
        return TargetOutput(
            logits=self.logits[index],
            layer_kv=self.layer_kv[index],
            hidden_states={k: v[index] for k, v in self.hidden_states.items()},
        )

    @staticmethod
    def concat(outs: list[TargetOutput]) -> TargetOutput:
        """Several passes' rows, in order."""
        return TargetOutput(
            logits=torch.cat([o.logits for o in outs]),
            layer_kv=torch.cat([o.layer_kv for o in outs]),
            hidden_states={
                k: torch.cat([o.hidden_states[k] for o in outs]) for k in outs[0].hidden_states
            },
        )


def check_supported(model: Any) -> None:
    """Raise a clear error if `model` is not a Llama-style causal LM the adapter can drive."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"target model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-style decoder layers with per-layer K/V)"
        )
    for path in _REQUIRED_MODULES:
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise ValueError(
                    f"target {type(model).__name__} has no `{path}`; the adapter needs "
                    f"{', '.join(_REQUIRED_MODULES)}"
                )
    attn = getattr(model.model.layers[0], "self_attn", None)
    if attn is None or not hasattr(attn, "k_proj"):
        raise ValueError(
            f"target {type(model).__name__} layers have no self_attn.k_proj (MLA or fused "
            "attention is not supported)"
        )


def target_shape(config: object) -> TargetShape:
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    hidden = config.hidden_size  # type: ignore[attr-defined]
    return TargetShape(
        num_layers=config.num_hidden_layers,  # type: ignore[attr-defined]
        hidden_size=hidden,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        vocab_size=config.vocab_size,  # type: ignore[attr-defined]
        rope_scaling=config_rope_scaling(config),
    )


def _sliding_windows(config: object, num_layers: int) -> list[int | None]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if getattr(config, "model_type", None) == "mistral":
        return [window] * num_layers
    return [None] * num_layers


class HFTarget:
    """A Hugging Face causal LM with a rollback-able KV cache for one sequence."""

    def __init__(self, model: Any) -> None:
        # `model` is any HF causal LM passing check_supported(); typed Any as HF modules are.
        check_supported(model)
        pack_linears(model)  # CPU: oneDNN on prepacked weights (model/packed_linear.py)
        self.model: Any = model.eval()
        self.config: Any = model.config
        inner: Any = model.model
        self.layers: Any = inner.layers
        self.embed_tokens: Any = inner.embed_tokens
        self.norm: Any = inner.norm
        self.rotary_emb: Any = inner.rotary_emb
        self.lm_head: Any = model.lm_head
        self.shape = target_shape(self.config)
        self.max_length: int = int(getattr(self.config, "max_position_embeddings", 2048))
        self._windows = _sliding_windows(self.config, self.shape.num_layers)
        self.cache = KVCache(self.shape.num_layers)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> HFTarget:
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target directory {path} has no config.json")
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa"
            )
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"could not load target model from {path}: {e}") from None
        return cls(model.to(device))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def seq_len(self) -> int:
        """Number of tokens whose K/V sit in the cache (all layers agree between calls)."""
        return self.cache.length(0)

    def reset(self) -> None:
        self.cache.reset()

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, E]."""
        return self.embed_tokens(token_ids)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, V] float32."""
        return self.lm_head(hidden).float()

    def vocab_head(self, token_ids: torch.Tensor) -> VocabHead:
        """`lm_logits` over the tokens `token_ids` (int64 [n], ascending) only: [T, E] -> [T, V]
        float32, -inf at the other tokens, from the head's rows of those tokens, copied here once
        (a drafter's draft vocabulary: build it once per proposer, not per step)."""
        return VocabHead(self.lm_head.weight, getattr(self.lm_head, "bias", None), token_ids)

    def additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """bool [..., T, S] (True = attend) -> additive float mask in the model's dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def causal_allowed(
        self, layer_idx: int, positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor:
        """bool [..., T, S] for positions [..., T] and key positions [..., S]: causal, within
        the layer's sliding window if it has one."""
        keys, queries = key_positions[..., None, :], positions[..., :, None]
        allowed = keys <= queries
        window = self._windows[layer_idx]
        if window is not None:
            allowed &= keys > queries - window
        return allowed

    def _cache_mask(self, cache: KVCache, layer_idx: int, positions: torch.Tensor) -> torch.Tensor:
        """[1, 1, T, S] over the layer's cached keys (positions 0..) plus the new ones."""
        keys = torch.arange(cache.length(layer_idx) + positions.shape[0], device=positions.device)
        return self.additive_mask(self.causal_allowed(layer_idx, positions, keys))[None, None]

    def run_layers(
        self,
        h: torch.Tensor,  # [B, T, E]
        positions: torch.Tensor,  # [T], or [B, T] when rows sit at different positions
        layer_ids: range,
        cache: Any,  # anything with KVCache.update()'s signature
        mask_for: Callable[[int], torch.Tensor],  # layer index -> additive [B|1, 1, T, S]
        **attention_kwargs: Any,  # passed to the layers' attention function
    ) -> torch.Tensor:
        pos = positions if positions.dim() == 2 else positions[None]
        position_embeddings = self.rotary_emb(h, pos)
        for i in layer_ids:
            out = self.layers[i](
                h,
                attention_mask=mask_for(i),
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=position_embeddings,
                **attention_kwargs,
            )
            h = out[0] if isinstance(out, tuple) else out
        return h

    def _run_cached(
        self, h: torch.Tensor, positions: torch.Tensor, layer_ids: range, cache: KVCache
    ) -> torch.Tensor:
        return self.run_layers(
            h, positions, layer_ids, cache, lambda i: self._cache_mask(cache, i, positions)
        )

    def _forward_hidden(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,  # anything with KVCache.update()'s signature
        wanted: set[int],
        mask_for: Callable[[int], torch.Tensor] | None = None,
        **attention_kwargs: Any,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """All layers + final norm on h [B, T, E]; returns (final [B, T, E], hidden dict).
        Masks default to causal over the cache; forward_tree passes its own."""
        hidden: dict[int, torch.Tensor] = {}
        num_layers = self.shape.num_layers
        masks = mask_for or (lambda i: self._cache_mask(cache, i, positions))
        cut_points = sorted({0, num_layers, *(i for i in wanted if i < num_layers)})
        for a, b in itertools.pairwise(cut_points):
            if a in wanted:
                hidden[a] = h
            h = self.run_layers(h, positions, range(a, b), cache, masks, **attention_kwargs)
        h = self.norm(h)
        if num_layers in wanted:
            hidden[num_layers] = h
        return h, hidden

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, hidden_layers: Sequence[int] = ()) -> TargetOutput:
        """Run T new tokens [T] after the cached prefix; their K/V stay in the cache."""
        start = self.seq_len
        if start + token_ids.shape[0] > self.max_length:
            raise ValueError(
                f"sequence of {start + token_ids.shape[0]} tokens exceeds the target's context "
                f"of {self.max_length} (max_position_embeddings)"
            )
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)
        h = self.embed_tokens(token_ids.to(self.device))[None]
        h, hidden = self._forward_hidden(h, positions, self.cache, set(hidden_layers))
        return TargetOutput(
            logits=self.lm_logits(h[0]),
            layer_kv=kv_rows(self.cache, start, start + token_ids.shape[0])[0],
            hidden_states={k: v[0] for k, v in hidden.items()},
        )

    @torch.no_grad()
    def forward_tree(
        self,
        token_ids: torch.Tensor,  # [n]: the root token, then the tree's nodes
        positions: torch.Tensor,  # [n]: absolute positions (root p, a node p + its depth)
        allowed: torch.Tensor,  # bool [n, n]: new token i sees new token j (self/ancestors)
        hidden_layers: Sequence[int] = (),
    ) -> TargetOutput:
        """Verify a draft tree in one pass: every new token sees the whole cached prefix and,
        among the new ones, what `allowed` permits. Their K/V are appended in the given order;
        compact with `self.cache.keep(...)` once the accepted path is known."""
        start = self.seq_len
        positions = positions.to(self.device)
        if int(positions.max()) >= self.max_length:  # device sync
            raise ValueError(f"tree reaches position {int(positions.max())}, beyond the context")
        prefix = torch.arange(start, device=self.device)
        key_positions = torch.cat([prefix, positions])
        visible = torch.cat(
            [
                torch.ones(len(positions), start, dtype=torch.bool, device=self.device),
                allowed.to(self.device),
            ],
            dim=1,
        )

        def mask_for(i: int) -> torch.Tensor:
            ok = visible & self.causal_allowed(i, positions, key_positions)
            return self.additive_mask(ok)[None, None]

        h = self.embed_tokens(token_ids.to(self.device))[None]
        wanted = set(hidden_layers)
        if use_kernels(self.device) and tree_kernel.routable(self.config, self._windows):
            # CUDA: our tree-masked attention kernel instead of SDPA over a dense mask.
            args = tree_kernel.kernel_args(allowed, start, self.device)
            with tree_kernel.tree_kernel_attention(self.config):
                h, hidden = self._forward_hidden(
                    h, positions, self.cache, wanted, mask_for, **{tree_kernel.KWARG: args}
                )
        else:
            h, hidden = self._forward_hidden(h, positions, self.cache, wanted, mask_for)
        return TargetOutput(
            logits=self.lm_logits(h[0]),
            layer_kv=kv_rows(self.cache, start, start + len(positions))[0],
            hidden_states={k: v[0] for k, v in hidden.items()},
        )

    @torch.no_grad()
    def forward_batch(
        self, input_ids: torch.Tensor, hidden_layers: Sequence[int] = ()
    ) -> TargetOutput:
        """Independent right-padded sequences [B, T] from scratch (the cache is untouched).

        Returns logits [B, T, V], layer_kv [B, T, L, 2*E_kv], hidden_states {l: [B, T, E]}.
        Padding sits after every real token, so the causal mask alone keeps it out.
        """
        cache = KVCache(self.shape.num_layers)
        positions = torch.arange(input_ids.shape[1], device=self.device)
        h = self.embed_tokens(input_ids.to(self.device))
        h, hidden = self._forward_hidden(h, positions, cache, set(hidden_layers))
        return TargetOutput(
            logits=self.lm_head(h).float(),
            layer_kv=kv_rows(cache, 0, input_ids.shape[1]),
            hidden_states=hidden,
        )

    @torch.no_grad()
    def forward_trees(
        self, batch: Sequence[TreeInput], hidden_layers: Sequence[int] = ()
    ) -> list[TargetOutput]:
        """`forward_tree` for several sequences in one pass, each after its own cached prefix
        (a server verifying many clients' drafts). Rows are padded to the longest input; the
        prefixes are padded to the longest one inside the pass (each sequence's cache gets only
        its own new K/V). Returns one TargetOutput per input, as forward_tree would."""
        device = self.device
        starts = [item.cache.length(0) for item in batch]
        sizes = [len(item.token_ids) for item in batch]
        b, t, s = len(batch), max(sizes), max(starts)
        ids = torch.zeros(b, t, dtype=torch.long, device=device)
        positions = torch.zeros(b, t, dtype=torch.long, device=device)
        visible = torch.zeros(b, t, s + t, dtype=torch.bool, device=device)
        for r, item in enumerate(batch):
            n = sizes[r]
            ids[r, :n] = item.token_ids
            positions[r, :n] = item.positions
            if int(item.positions.max()) >= self.max_length:
                raise ValueError(
                    f"tree reaches position {int(item.positions.max())}, beyond the context"
                )
            visible[r, :n, : starts[r]] = True
            visible[r, :n, s : s + n] = item.allowed
            visible[r, n:, s + n :] = torch.eye(t - n, dtype=torch.bool, device=device)  # padding
        prefix = torch.arange(s, device=device).expand(b, s)
        key_positions = torch.cat([prefix, positions], dim=1)  # [B, S + T]

        def mask_for(i: int) -> torch.Tensor:
            ok = visible & self.causal_allowed(i, positions, key_positions)
            return self.additive_mask(ok)[:, None]

        caches = _PaddedCaches([item.cache for item in batch], starts, sizes, s)
        h = self.embed_tokens(ids)
        h, hidden = self._forward_hidden(h, positions, caches, set(hidden_layers), mask_for)
        logits = self.lm_head(h).float()
        return [
            TargetOutput(
                logits=logits[r, : sizes[r]],
                layer_kv=kv_rows(item.cache, starts[r], starts[r] + sizes[r])[0],
                hidden_states={k: v[r, : sizes[r]] for k, v in hidden.items()},
            )
            for r, item in enumerate(batch)
        ]

    @torch.no_grad()
    def run_tail_layers(
        self, hidden: torch.Tensor, positions: torch.Tensor, num_layers: int
    ) -> torch.Tensor:
        """TLI: run the last `num_layers` layers and the final norm on hidden [T, E] at positions
        [T]. Their K/V are appended to those layers' cache: crop back to the verified length
        before the next target pass."""
        total = self.shape.num_layers
        layer_ids = range(total - num_layers, total)
        h = self._run_cached(hidden[None].to(self.dtype), positions, layer_ids, self.cache)
        return self.norm(h)[0]


def kv_rows(cache: KVCache, start: int, end: int) -> torch.Tensor:
    """K|V of cached positions [start, end) in every layer -> [B, T, L, 2*E_kv], per layer
    `[k_h0 | v_h0 | k_h1 | v_h1 | ...]`."""
    per_layer = []
    for i in range(cache.num_layers):
        k, v = cache.get(i)  # [B, Hkv, S, D]
        kv = torch.stack([k[:, :, start:end], v[:, :, start:end]], dim=3)  # [B, Hkv, T, 2, D]
        per_layer.append(kv.permute(0, 2, 1, 3, 4).flatten(2))  # [B, T, 2*E_kv]
    return torch.stack(per_layer, dim=2)


def split_kv(layer_kv: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's [B, T, 2*E_kv] -> K, V [B, Hkv, T, D] (the inverse of kv_rows' layout)."""
    b, t, _ = layer_kv.shape
    kv = layer_kv.view(b, t, num_kv_heads, 2, -1).permute(0, 2, 3, 1, 4)  # [B, Hkv, 2, T, D]
    return kv[:, :, 0], kv[:, :, 1]


@dataclass
class TreeInput:
    """One sequence of a `forward_trees` pass: its cache, and the `forward_tree` inputs."""

    cache: KVCache
    token_ids: torch.Tensor  # [n]: the root token, then the tree's nodes
    positions: torch.Tensor  # [n]
    allowed: torch.Tensor  # bool [n, n]


class _PaddedCaches:
    """The `update()` the layers call during `forward_trees`: each sequence's new K/V go to its
    own cache; the layer attends over [B, Hkv, S + T, D], prefixes in columns < S (padded to the
    longest), the new keys of every row in columns S.. (masks hide what a row does not own)."""

    def __init__(self, caches: list[KVCache], starts: list[int], sizes: list[int], s: int) -> None:
        self.caches, self.starts, self.sizes, self.s = caches, starts, sizes, s

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kw: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, heads, t, d = key.shape
        keys = key.new_zeros(b, heads, self.s + t, d)
        values = value.new_zeros(b, value.shape[1], self.s + t, value.shape[3])
        for r, cache in enumerate(self.caches):
            n, start = self.sizes[r], self.starts[r]
            k, v = cache.update(key[r : r + 1, :, :n], value[r : r + 1, :, :n], layer_idx)
            keys[r, :, :start] = k[0, :, :start]
            values[r, :, :start] = v[0, :, :start]
        keys[:, :, self.s :] = key
        values[:, :, self.s :] = value
        return keys, values
