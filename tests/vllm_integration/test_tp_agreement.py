"""The tensor-parallel ranks' host-side agreements (vllm_plugin/tensor_parallel.py), on two real
processes over a gloo group standing in for vLLM's TP group's CPU group: rank 0's draft steps
reach every rank (`rank0_value`), and the captured graphs are kept only where every rank
captured them (`on_every_rank`; control: one rank failing makes both drop them)."""

from __future__ import annotations

import json
import os
import socket
import types
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.vllm


def _rank(rank: int, port: int, out: str) -> None:
    import vllm.distributed

    from vllm_moa.vllm_plugin import tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = types.SimpleNamespace(cpu_group=dist.group.WORLD, ranks=[0, 1])
    vllm.distributed.get_tp_group = lambda: group  # the TP group's CPU group, as vLLM's
    got = {
        "steps": tensor_parallel.rank0_value(3 + rank),  # rank 0 chose 3, rank 1 would say 4
        "both_captured": tensor_parallel.on_every_rank(True),
        "rank1_failed": tensor_parallel.on_every_rank(rank == 0),  # the control
    }
    Path(out, f"{rank}.json").write_text(json.dumps(got))
    # Leave without tearing gloo down: under load its teardown, racing the other rank's, can
    # abort a process after both wrote their answers ("terminate called without an active
    # exception", 1 run in ~25 on 2 busy cores; CI failed on it once). The barrier makes both
    # ranks finish every collective first; os._exit skips the teardown, not any check.
    dist.barrier()
    os._exit(0)


def test_every_rank_takes_rank0s_steps_and_keeps_graphs_only_if_all_captured(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert got == [{"steps": 3, "both_captured": True, "rank1_failed": False}] * 2
