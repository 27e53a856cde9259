"""Compare two OpenAI-compatible servers of the same target, plain `vllm serve` and `vllm serve`
with MoA speculative decoding: the same greedy requests to each in alternating rounds, then
their outputs side by side, tokens/s, MoA's acceptance and the speed-up (a JSON and a plot too).

    python examples/compare_servers.py --plain http://127.0.0.1:8001 --moa http://127.0.0.1:8000

Requests go one at a time (batch 1, where speculation pays most); after a warm-up request to
each server, every round sends all prompts to one server, then to the other (the order
alternating), so the two see the same machine load. tokens/s: completion tokens over the
wall-clock time of the round's requests. MoA's acceptance comes from its /metrics
(`vllm:spec_decode_*` counters, read before and after). `scripts/demo.sh` runs this on the
demo pair.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from vllm_moa.demo import PROMPTS  # Python openings the demo target continues

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_client import spec_decode_metrics


def _round(client: OpenAI, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    texts, tokens, began = [], 0, time.perf_counter()
    for prompt in prompts:
        done = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        texts.append(done.choices[0].text)
        tokens += done.usage.completion_tokens if done.usage else 0
    seconds = time.perf_counter() - began
    return {"texts": texts, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def compare(
    urls: dict[str, str], prompts: list[str], max_tokens: int, rounds: int
) -> dict[str, Any]:
    clients = {k: OpenAI(base_url=u.rstrip("/") + "/v1", api_key="EMPTY") for k, u in urls.items()}
    models = {k: c.models.list().data[0].id for k, c in clients.items()}
    for k in clients:  # warm-up
        _round(clients[k], models[k], prompts[:1], 8)
    before = spec_decode_metrics(urls["moa"])
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in clients}
    for r in range(rounds):
        for k in list(clients) if r % 2 == 0 else list(clients)[::-1]:
            runs[k].append(_round(clients[k], models[k], prompts, max_tokens))
            speed = runs[k][-1]["tokens_per_s"]
            print(f"round {r + 1}/{rounds} {k}: {speed:.1f} tok/s", flush=True)
    after = spec_decode_metrics(urls["moa"])
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("vllm:spec_decode_num_drafts", 0.0)
    drafted = delta.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    ratios = [
        m["tokens_per_s"] / p["tokens_per_s"]
        for m, p in zip(runs["moa"], runs["plain"], strict=True)
    ]
    return {
        "config": {"urls": urls, "models": models, "prompts": prompts}
        | {"max_tokens": max_tokens, "rounds": rounds},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": runs,
        "tokens_per_s": {
            k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()
        },
        "speedup": statistics.median(ratios),
        "identical": sum(
            a == b
            for a, b in zip(runs["plain"][-1]["texts"], runs["moa"][-1]["texts"], strict=True)
        ),
        "moa_drafts": int(drafts),
        "moa_draft_tokens": int(drafted),
        "moa_accepted_tokens": int(accepted),
        # tau: tokens per verify pass of the passes that verified drafts (vLLM's definition)
        "moa_tau": 1 + accepted / drafts if drafts else None,
    }


def report(result: dict[str, Any]) -> None:
    prompts, runs = result["config"]["prompts"], result["rounds"]
    for i, prompt in enumerate(prompts):
        plain, moa = runs["plain"][-1]["texts"][i], runs["moa"][-1]["texts"][i]
        same = "identical" if plain == moa else "DIFFERENT"
        print(f"\n--- {prompt!r}: plain and MoA outputs {same} ---\n{prompt}{moa}")
        if plain != moa:
            print(f"--- plain ---\n{prompt}{plain}")
    tps, tau = result["tokens_per_s"], result["moa_tau"]
    print(f"\n{'':30}{'plain':>10}{'MoA':>10}")
    print(f"{'tokens/s (median of rounds)':30}{tps['plain']:>10.1f}{tps['moa']:>10.1f}")
    shown = "-" if tau is None else f"{tau:.2f}"  # None: no drafts were verified (adaptive)
    print(f"{'tau (tokens per verify pass)':30}{'':>10}{shown:>10}")
    print(f"\noutputs identical: {result['identical']}/{len(prompts)} prompts")
    print(f"speed-up: {result['speedup']:.2f}x (MoA over plain, median of the rounds' ratios)")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, runs) in enumerate(result["rounds"].items()):
        values = [r["tokens_per_s"] for r in runs]
        xs = [i + 0.8 * (j / max(len(values) - 1, 1) - 0.5) * 0.5 for j in range(len(values))]
        label = f"{'MoA' if name == 'moa' else name} (median)"
        ax.bar(i, statistics.median(values), width=0.6, alpha=0.5, label=label)
        ax.plot(xs, values, "k.", label="rounds" if i == 0 else None)
    names = {"plain": "plain", "moa": "MoA"}
    ax.set_xticks(range(len(result["rounds"])), [names[n] for n in result["rounds"]])
    ax.set_ylabel("tokens/s (batch 1)")
    tau = result["moa_tau"]
    ax.set_title(
        f"MoA: {result['speedup']:.2f}x plain, tau {tau:.2f}, "
        f"{result['identical']}/{len(result['config']['prompts'])} outputs identical"
        if tau
        else "no drafts accepted"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plain", required=True, help="base URL of the plain server")
    p.add_argument("--moa", required=True, help="base URL of the MoA server")
    p.add_argument("--prompt", action="append", help="repeat for several (default: 4 built in)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.png")
    args = p.parse_args(argv)
    prompts = args.prompt or list(PROMPTS)
    result = compare({"plain": args.plain, "moa": args.moa}, prompts, args.max_tokens, args.rounds)
    report(result)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        try:
            plot(result, out.with_suffix(".png"))
        except ImportError:
            print("(no plot: matplotlib is not installed)")
        print(f"wrote {out.with_suffix('.json')} and its plot")
    return 0 if result["identical"] == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
