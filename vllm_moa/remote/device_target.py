"""The target's parts a client device holds: token embeddings, final norm, LM head and, for MoA
with TLI = N, the target's last N decoder layers; read from the target directory without the
rest of its weights.

It is an `HFTarget` the standalone proposers run on unchanged: the layers keep their absolute
indices (L-N..L-1, as the proposers address them on the full target), and their cache holds
the K/V the server sent for the verified tokens, plus the proposer's temporary draft K/V. It
never runs a target pass (`forward*` refuse).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vllm_moa.hf_target.adapter import (
    SUPPORTED_MODEL_TYPES,
    HFTarget,
    TargetOutput,
    _sliding_windows,
    split_kv,
    target_shape,
)
from vllm_moa.model.kv_cache import KVCache


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"target directory {path} has no model.safetensors (or its index)")


def _read_tensors(path: Path, wanted: dict[str, str]) -> dict[str, torch.Tensor]:
    """Only the `wanted` tensors (file name -> name in the partial model) from the weights."""
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name in wanted:
                    out[wanted[name]] = f.get_tensor(name)
    return out


class DeviceTarget(HFTarget):
    def __init__(self, model: Any, full_config: Any, tail: int) -> None:
        # Not HFTarget.__init__: the partial model has only the tail's layers (maybe none).
        self.model = model.eval()
        self.config = full_config
        self.shape = target_shape(full_config)
        total = self.shape.num_layers
        self.tail = tail
        inner = model.model
        self.layers: Any = {total - tail + i: layer for i, layer in enumerate(inner.layers)}
        self.embed_tokens = inner.embed_tokens
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = model.lm_head
        self.max_length = int(getattr(full_config, "max_position_embeddings", 2048))
        self._windows = _sliding_windows(full_config, total)
        self.cache = KVCache(total)
        self._length = 0  # verified tokens (the cache's length when there are tail layers)

    @classmethod
    def load(
        cls, path: str | Path, tail: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> DeviceTarget:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target directory {path} has no config.json")
        config = AutoConfig.from_pretrained(path)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"target model_type {config.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        total = config.num_hidden_layers
        if not 0 <= tail <= total:
            raise ValueError(f"the drafter's TLI={tail} exceeds the target's {total} layers")
        part = copy.deepcopy(config)
        part.num_hidden_layers = tail
        if getattr(config, "layer_types", None):
            part.layer_types = list(config.layer_types)[total - tail :]
        model: Any = AutoModelForCausalLM.from_config(part, dtype=dtype, attn_implementation="sdpa")
        wanted = {"model.embed_tokens.weight": "model.embed_tokens.weight"}
        wanted["model.norm.weight"] = "model.norm.weight"
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if not tied:
            wanted["lm_head.weight"] = "lm_head.weight"
        own = set(model.state_dict())
        for i in range(tail):
            prefix = f"model.layers.{i}."
            for name in own:
                if name.startswith(prefix):
                    wanted[f"model.layers.{total - tail + i}.{name[len(prefix) :]}"] = name
        state = _read_tensors(path, wanted)
        missing = sorted(set(wanted.values()) - set(state))
        if missing:
            raise ValueError(f"target weights in {path} lack {', '.join(missing[:5])}")
        model.load_state_dict(state, strict=False)
        if tied:
            model.tie_weights()
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.layer_idx = total - tail + i  # the cache slot it updates
        return cls(model.to(device), config, tail)

    @property
    def seq_len(self) -> int:
        return self.cache.length(self.shape.num_layers - 1) if self.tail else self._length

    def reset(self) -> None:
        self.cache.reset()
        self._length = 0

    def crop(self, length: int) -> None:
        self.cache.crop(length)
        self._length = min(self._length, length)

    def append_verified(self, n: int, tail_kv: torch.Tensor | None) -> None:
        """n newly verified tokens; with TLI, their K/V in the tail layers [n, N, 2*E_kv]."""
        if self.tail:
            if tail_kv is None or tail_kv.shape[:2] != (n, self.tail):
                raise ValueError(f"expected the tail layers' K/V for {n} tokens")
            rows = tail_kv.flatten(2).to(self.dtype)
            for j in range(self.tail):
                k, v = split_kv(rows[None, :, j], self.shape.num_kv_heads)
                self.cache.update(k, v, self.shape.num_layers - self.tail + j)
        self._length += n

    def forward(self, *args: Any, **kwargs: Any) -> TargetOutput:
        raise RuntimeError("a DeviceTarget holds no full target: the server runs target passes")

    forward_tree = forward_batch = forward
    forward_trees = forward  # type: ignore[assignment]
