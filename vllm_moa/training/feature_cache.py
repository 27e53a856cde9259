"""Offline distillation: the target's per-layer K|V and hidden states, computed once and stored
in safetensors shards, so later epochs (and other drafters) train without running the target.

Logits are not stored: they are the target's LM head applied to the stored final hidden state,
recomputed per batch (a [T, V] tensor per example would dwarf everything else at real vocab
sizes). Each example is stored unpadded under `ex{index}.layer_kv` / `ex{index}.h{layer}`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.training.data import Example, collate

META = "meta.json"


def fingerprint(examples: Sequence[Example], target_dir: str, hidden_layers: Sequence[int]) -> str:
    h = hashlib.sha256()
    root = Path(target_dir).resolve()
    # The weights' sizes and times too: a target retrained in place invalidates the cache.
    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.glob("*.safetensors")
    )
    h.update(json.dumps([str(root), weights, sorted(hidden_layers)]).encode())
    for e in examples:
        h.update(json.dumps(e.input_ids).encode())
    return h.hexdigest()[:16]


class FeatureCache:
    def __init__(self, root: Path, meta: dict[str, Any]) -> None:
        self.root = root
        self.meta = meta
        self.shard_of: list[str] = meta["shard_of"]  # example index -> shard file name
        self.hidden_layers: list[int] = meta["hidden_layers"]
        self._handles: dict[str, Any] = {}

    @classmethod
    def open_or_build(
        cls,
        root: Path,
        target: HFTarget,
        target_dir: str,
        examples: Sequence[Example],
        hidden_layers: Sequence[int],
        batch_size: int = 8,
        workers: int = 1,
    ) -> FeatureCache:
        """Reuse the cache at root if it was built from the same examples, target and layers.

        workers > 1 fans the computation out over Ray tasks (one GPU each when CUDA is there),
        each writing its own shards for a contiguous slice of the examples."""
        layers = sorted({*hidden_layers, target.shape.num_layers})  # final state -> logits
        key = fingerprint(examples, target_dir, layers)
        meta_path = root / META
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            if meta.get("fingerprint") == key:
                return cls(root, meta)
        root.mkdir(parents=True, exist_ok=True)
        if workers > 1:
            shard_of = _build_with_ray(root, target_dir, examples, layers, batch_size, workers)
        else:
            shard_of = write_shards(root, target, examples, 0, layers, batch_size)
        meta = {"fingerprint": key, "hidden_layers": layers, "shard_of": shard_of}
        meta_path.write_text(json.dumps(meta))  # written last: a partial cache is rebuilt
        return cls(root, meta)

    def _get(self, index: int, name: str) -> torch.Tensor:
        shard = self.shard_of[index]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.root / shard), "pt")
        return self._handles[shard].get_tensor(f"ex{index}.{name}")

    def target_output(self, indices: Sequence[int], target: HFTarget) -> TargetOutput:
        """The stored features of examples `indices`, right-padded like collate() -> [B, T, ...]."""
        rows = [self._get(i, "layer_kv") for i in indices]
        width = max(r.shape[0] for r in rows)

        def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
            out = tensors[0].new_zeros((len(tensors), width, *tensors[0].shape[1:]))
            for b, t in enumerate(tensors):
                out[b, : t.shape[0]] = t
            return out.to(target.device)

        hidden = {
            layer: stack([self._get(i, f"h{layer}") for i in indices])
            for layer in self.hidden_layers
        }
        final = hidden[target.shape.num_layers]
        with torch.no_grad():
            logits = target.lm_head(final).float()
        return TargetOutput(logits=logits, layer_kv=stack(rows), hidden_states=hidden)


def write_shards(
    root: Path,
    target: HFTarget,
    examples: Sequence[Example],
    first_index: int,
    layers: Sequence[int],
    batch_size: int,
    shard_tokens: int = 1 << 16,
) -> list[str]:
    """Compute and store examples [first_index, first_index + len); returns each one's shard."""
    shard_of: list[str] = []
    pending: dict[str, torch.Tensor] = {}
    tokens, shard = 0, 0
    prefix = f"shard-{first_index:08d}"

    def flush() -> None:
        nonlocal pending, tokens, shard
        if pending:
            save_file(pending, str(root / f"{prefix}-{shard:05d}.safetensors"))
            pending, tokens, shard = {}, 0, shard + 1

    for start in tqdm(range(0, len(examples), batch_size), desc="cache features"):
        chunk = examples[start : start + batch_size]
        out = target.forward_batch(collate(chunk).input_ids, layers)
        for j, e in enumerate(chunk):
            n, i = len(e.input_ids), first_index + start + j
            pending[f"ex{i}.layer_kv"] = out.layer_kv[j, :n].contiguous().cpu()
            for layer in layers:
                pending[f"ex{i}.h{layer}"] = out.hidden_states[layer][j, :n].contiguous().cpu()
            shard_of.append(f"{prefix}-{shard:05d}.safetensors")
            tokens += n
        if tokens >= shard_tokens:
            flush()
    flush()
    return shard_of


def _ray_job(
    root: str, target_dir: str, examples: list[Example], first: int, layers: list[int], bs: int
) -> list[str]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = HFTarget.from_pretrained(target_dir, device=device)
    return write_shards(Path(root), target, examples, first, layers, bs)


def _build_with_ray(
    root: Path,
    target_dir: str,
    examples: Sequence[Example],
    layers: Sequence[int],
    batch_size: int,
    workers: int,
) -> list[str]:
    try:
        import ray
    except ImportError:
        raise ValueError("cache workers > 1 needs Ray: pip install ray") from None
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    gpus = 1 if torch.cuda.is_available() else 0
    job = ray.remote(num_gpus=gpus, num_cpus=1)(_ray_job)
    size = -(-len(examples) // workers)
    refs = [
        job.remote(str(root), target_dir, list(examples[s : s + size]), s, list(layers), batch_size)
        for s in range(0, len(examples), size)
    ]
    return [shard for part in ray.get(refs) for shard in part]
