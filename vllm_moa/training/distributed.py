"""Data parallelism with torch.distributed (launch with torchrun; gloo on CPU, nccl on CUDA)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    device: str = "cpu"

    @classmethod
    def from_env(cls, device: str) -> DistContext:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls(0, 1, device)
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if device.startswith("cuda"):
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return cls(rank, world, device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [int(self.device.split(":")[1])] if self.device.startswith("cuda") else None
        return DistributedDataParallel(model, device_ids=ids)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Average scalars over ranks (for logging)."""
        if self.world == 1:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(values, (t / self.world).tolist(), strict=True))

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()
