"""The drafts check of the vLLM tests, and what it needs.

vLLM's verifier makes greedy output equal plain decoding whatever is drafted, so output equality
(and `accepted > 0`) proves little about the drafter. What does: every chain MoA drafts in vLLM
(traced, VLLM_MOA_TRACE: one JSON line per drafted request, from every rank under tensor
parallelism) equals the standalone proposer's at the same context. That holds only if the
drafter's drafts depend on what it reads: see conftest.py's `sensitive_drafter` and
`sharp_drafter` (the test pair's trained drafters barely depend on their memory) and
test_vllm_drafts_check.py's controls.

Also here: `ENGINES`, a script that runs vLLM engines one after another in one interpreter (one
start-up for several runs), and `worker_setup_env`, which patches every process vLLM starts
(tensor-parallel workers are spawned: a parent's patches do not reach them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SETUP_SITE = Path(__file__).resolve().parent / "setup_site"
SETUP_ENV = "VLLM_MOA_TEST_SETUP"

# Runs engines one after another in one process: {"target", "prompts", "runs": [{"target",
# "prompts", "spec", "trace", "env", "setup", "kwargs", "params", "repeat"}]} -> per run its
# outputs (per pass) and metrics; "env" is set and "setup" (Python) run before the run's engine
# starts; a run's "target" and "prompts" (else the job's) are served.
ENGINES = """
import gc, json, os, sys
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
results = []
for run in args["runs"]:
    os.environ.pop("VLLM_MOA_TRACE", None)
    if run.get("trace"):
        os.environ["VLLM_MOA_TRACE"] = run["trace"]
    os.environ.update(run.get("env", {}))
    exec(run.get("setup", ""))
    kwargs = {"max_model_len": 512, **run.get("kwargs", {})}
    llm = LLM(model=run.get("target", args["target"]), dtype="float32", enforce_eager=True,
              seed=0, speculative_config=run.get("spec"), disable_log_stats=False, **kwargs)
    params = SamplingParams(**run.get("params", {"temperature": 0.0, "max_tokens": 32,
                                                 "ignore_eos": True}))
    passes = []
    for _ in range(run.get("repeat", 1)):
        prompts = run.get("prompts", args["prompts"])
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
        passes.append([list(o.outputs[0].token_ids) for o in outs])
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:spec_decode", "vllm:prefix_cache", "vllm:num_preemptions")):
            metrics[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    results.append({"passes": passes, "metrics": metrics})
    del llm
    gc.collect()
print("RESULT " + json.dumps(results))
"""


def moa(drafter: Path, k: int = 4, **keys: object) -> dict:
    """A speculative config for MoA with `drafter`, K = `k`, and vLLM config `keys`."""
    return {"method": "moa", "model": str(drafter), "num_speculative_tokens": k, **keys}


def encode(target: Path, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    return [tokenizer.encode(p) for p in prompts]


def worker_setup_env(source: str) -> dict[str, str]:
    """Environment for a subprocess in which every Python process vLLM starts runs `source` at
    start-up (setup_site/sitecustomize.py), before vLLM builds anything."""
    path = os.pathsep.join(
        p for p in (str(SETUP_SITE), str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    return {"PYTHONPATH": path, SETUP_ENV: source}


def traced_lines(path: Path) -> list[tuple[tuple[int, ...], list[int]]]:
    """Every traced (context, chain), in order (under TP each rank's lines)."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out.append((tuple(rec["tokens"]), rec["drafts"]))
    return out


def traced_chains(path: Path) -> dict[tuple[int, ...], list[int]]:
    """{context: chain} of a trace (a context traced twice: its last chain)."""
    return dict(traced_lines(path))


def plain_greedy(target_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain greedy decoding of each prompt by the standalone target (fp32): what vLLM's greedy
    output is with or without speculation (the standalone engine's output too)."""
    from vllm_moa.hf_target.adapter import HFTarget

    target = HFTarget.from_pretrained(target_dir, dtype=torch.float32)
    out = []
    for ids in prompts:
        target.reset()
        token = int(target.forward(torch.tensor(ids)).logits[-1].argmax())
        tokens = [token]
        while len(tokens) < max_tokens:
            token = int(target.forward(torch.tensor([token])).logits[-1].argmax())
            tokens.append(token)
        out.append(tokens)
    return out


def reference_chains(
    target_dir: Path, drafter_dir: Path, contexts: list[tuple[int, ...]], k: int
) -> dict[tuple[int, ...], list[int]]:
    """The standalone MoAProposer's greedy chain of `k` drafts after each context (fp32)."""
    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.decoding.sampling import SamplingParams
    from vllm_moa.factories.proposers import make_proposer
    from vllm_moa.hf_target.adapter import HFTarget

    target = HFTarget.from_pretrained(target_dir, dtype=torch.float32)
    drafter = load_drafter(drafter_dir, target=target.shape, dtype=torch.float32)
    proposer = make_proposer(drafter, target)
    out = {}
    for context in contexts:
        target.reset()
        prefix = list(context[:-1])
        proposer.start(prefix, target.forward(torch.tensor(prefix), proposer.hidden_layers))
        out[context] = proposer.propose(context[-1], k, SamplingParams(), None).tokens
    return out


def differing_chains(
    target: Path, drafter: Path, trace: Path, k: int
) -> tuple[list[tuple[tuple[int, ...], list[int], list[int]]], int]:
    """(context, traced chain, standalone chain) of every traced line whose chain is not the
    standalone proposer's at its context (as far as the traced chain goes), and the number of
    lines."""
    lines = traced_lines(trace)
    reference = reference_chains(target, drafter, list(dict(lines)), k)
    wrong = [(c, chain, reference[c]) for c, chain in lines if chain != reference[c][: len(chain)]]
    return wrong, len(lines)


def fewest_draft_steps(requests: int, max_tokens: int, k: int) -> int:
    """The fewest draft phases that greedy requests of `max_tokens` can take at a fixed K,
    whatever is accepted: the prefill emits the first token and each step at most K + 1. A floor
    on contexts drafted from that holds on any CPU (how many drafts land moves with the
    machine's floating-point paths, which decide the near ties of a random drafter's logits)."""
    return requests * -(-(max_tokens - 1) // (k + 1))


def assert_chains_are_the_standalone_proposers(
    target: Path, drafter: Path, trace: Path, k: int, at_least: int
) -> None:
    """Every chain traced (every rank's) is the standalone proposer's at its context, and at
    least `at_least` distinct contexts were drafted from."""
    contexts = len(traced_chains(trace))
    assert contexts >= at_least, f"only {contexts} contexts drafted from"
    wrong, lines = differing_chains(target, drafter, trace, k)
    example = [(len(c), got, ref) for c, got, ref in wrong[:3]]
    assert not wrong, (
        f"{len(wrong)} of {lines} chains differ from the standalone proposer: "
        f"(context length, drafted, standalone) {example}"
    )
