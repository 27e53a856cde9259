"""Host-built index tensors onto the device without stalling the host.

A copy from pageable host memory makes the host wait until the copy ran, i.e. until every
kernel already queued on the stream finished: the proposer builds several small index tensors
per step (token ids, positions, rows, slots) between its kernels, and each such copy would
drain the queue. Staged through pinned memory, the copy is asynchronous (PyTorch's pinned-memory
cache keeps the staging block until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(data: Sequence[int] | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host ints (a list, or a CPU tensor) -> a tensor on `device`; int64 for lists."""
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=torch.long)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
