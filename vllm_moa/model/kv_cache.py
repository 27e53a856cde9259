"""A contiguous per-layer KV cache that can be rolled back (cropped) after verification."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values per layer, each [B, Hkv, S, D], grown in place with amortised doubling.

    `update(k, v, layer_idx)` has the signature Hugging Face attention layers call on their
    `past_key_values`, so the same object serves the target adapter and the drafter's SA.
    """

    def __init__(self, num_layers: int) -> None:
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._lengths = [0] * num_layers

    @property
    def num_layers(self) -> int:
        return len(self._lengths)

    def length(self, layer_idx: int = 0) -> int:
        return self._lengths[layer_idx]

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value [B, Hkv, S_new, D]; return the layer's full K, V [B, Hkv, S, D]."""
        n = self._lengths[layer_idx]
        new = n + key.shape[2]
        buf_k, buf_v = self._keys[layer_idx], self._values[layer_idx]
        if buf_k is None or buf_v is None or buf_k.shape[2] < new:
            cap = max(new, 2 * (buf_k.shape[2] if buf_k is not None else 0), 16)
            shape = (*key.shape[:2], cap, key.shape[3])
            grown_k = key.new_empty(shape)
            grown_v = value.new_empty((*value.shape[:2], cap, value.shape[3]))
            if buf_k is not None and buf_v is not None and n:
                grown_k[:, :, :n] = buf_k[:, :, :n]
                grown_v[:, :, :n] = buf_v[:, :, :n]
            self._keys[layer_idx], self._values[layer_idx] = grown_k, grown_v
            buf_k, buf_v = grown_k, grown_v
        buf_k[:, :, n:new] = key
        buf_v[:, :, n:new] = value
        self._lengths[layer_idx] = new
        return buf_k[:, :, :new], buf_v[:, :, :new]

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K, V [B, Hkv, S, D]."""
        k, v = self._keys[layer_idx], self._values[layer_idx]
        if k is None or v is None:
            raise RuntimeError(f"KV cache layer {layer_idx} is empty")
        n = self._lengths[layer_idx]
        return k[:, :, :n], v[:, :, :n]

    def crop(self, length: int) -> None:
        """Forget everything at positions >= length, in every layer (shorter layers unchanged)."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        self._lengths = [min(n, length) for n in self._lengths]

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep positions < start, then the given absolute rows (>= start, increasing) moved to
        start, start+1, ... in every layer: compaction after tree verification."""
        index = None
        for i in range(self.num_layers):
            k, v = self._keys[i], self._values[i]
            if k is None or v is None:
                continue
            if index is None:
                index = torch.tensor(rows, device=k.device, dtype=torch.long)
            k[:, :, start : start + len(rows)] = k[:, :, index]
            v[:, :, start : start + len(rows)] = v[:, :, index]
            self._lengths[i] = start + len(rows)

    def reset(self) -> None:
        self._lengths = [0] * self.num_layers
