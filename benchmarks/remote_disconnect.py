"""What a client writes alone after losing its server (the MoA paper's Table 4 analogue).

    python -m benchmarks.remote_disconnect --target DIR --drafter DIR [DIR ...] \
        --prompts ../shared/data/HumanEval.jsonl.gz \
        --out benchmarks/results/remote/remote_disconnect.json

For each drafter and each B in `--after` (1, 10, 25, 50): every prompt is decoded by a client
(greedy chains of K) whose link is dropped once B tokens are out (`disconnect_after`; a cycle
that straddles B completes, so the verified prefix can be a few tokens longer); the client then
finishes the response alone. The locally written continuation is scored by the target: its mean
log-likelihood per token (the target's log-probability of each continuation token given all
before it) and its agreement with the target's own greedy continuation (the fraction of
positions where they hold the same token, and the length of the common prefix). "stop" is an
API call cut at the same point: it writes nothing. Writes a JSON and a PNG.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch


def _server(target_dir: str, drafter_dir: str) -> Any:
    """An in-process server (timing is not measured here)."""
    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.checkpoint.io import drafter_dir_of
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.remote.server import BackgroundServer
    from vllm_moa.remote.split import ServerHalf, fingerprint
    from vllm_moa.remote.verifier import Verifier

    target = HFTarget.from_pretrained(target_dir)
    path = drafter_dir_of(drafter_dir)
    drafter = load_drafter(path, target=target.shape)
    half = ServerHalf(drafter, target.shape.num_layers)
    return BackgroundServer(Verifier(target, half, fingerprint(path), []))


@torch.no_grad()
def _score(model: Any, prompt: list[int], tokens: list[int], start: int) -> float:
    """Mean log-probability under the target of tokens[start:] given what precedes each."""
    ids = torch.tensor([prompt + tokens])
    logp = model(ids).logits[0].float().log_softmax(-1)
    first = len(prompt) + start
    picked = logp[first - 1 : len(prompt) + len(tokens) - 1].gather(1, ids[0, first:, None])
    return float(picked.mean())


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.testbed.evaluate import read_prompts
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.remote.client import RemoteClient

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [
        tokenizer(p)["input_ids"] for p in read_prompts(Path(args.prompts), args.num_prompts)
    ]
    model = AutoModelForCausalLM.from_pretrained(args.target).eval()
    plain = SpeculativeEngine(HFTarget.from_pretrained(args.target))
    greedy = [plain.generate(ids, args.max_tokens).token_ids for ids in prompts]
    rows = []
    for drafter in args.drafter:
        server = _server(args.target, drafter)
        client = RemoteClient(server.address, args.target, drafter)
        for after in args.after:
            loglik, agree, prefix, cut, written = [], [], [], [], []
            for ids, want in zip(prompts, greedy, strict=True):
                r = client.generate(
                    ids, args.max_tokens, num_speculative_tokens=args.k, disconnect_after=after
                )
                d = r.disconnected_at if r.disconnected_at is not None else len(r.token_ids)
                cont, ref = r.token_ids[d:], want[d:]
                cut.append(d)
                written.append(len(cont))
                if cont:
                    loglik.append(_score(model, ids, r.token_ids, d))
                    same = [a == b for a, b in zip(cont, ref, strict=False)]
                    agree.append(sum(same) / len(cont))
                    prefix.append(next((i for i, s in enumerate(same) if not s), len(same)))
            row = {
                "drafter": drafter,
                "kind": client.kind,
                "tli": client.tli,
                "after": after,
                "verified_tokens": statistics.mean(cut),
                "written_alone": statistics.mean(written),
                "loglik_per_token": statistics.mean(loglik) if loglik else None,
                "agreement": statistics.mean(agree) if agree else None,
                "common_prefix": statistics.mean(prefix) if prefix else None,
            }
            rows.append(row)
            print(row, flush=True)
        server.stop()
    for after in args.after:  # the API call: nothing after the cut
        rows.append({"drafter": "stop", "kind": "stop", "tli": 0, "after": after,
                     "verified_tokens": after, "written_alone": 0, "loglik_per_token": None,
                     "agreement": 0.0, "common_prefix": 0.0})  # fmt: skip
    return rows


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for name in dict.fromkeys(r["drafter"] for r in rows):
        mine = [r for r in rows if r["drafter"] == name]
        label = "stop (API call)" if name == "stop" else Path(name).parent.name or name
        ax1.plot([r["after"] for r in mine], [r["agreement"] for r in mine], "o-", label=label)
        if name != "stop":
            ax2.plot([r["after"] for r in mine], [r["loglik_per_token"] for r in mine], "o-",
                     label=label)  # fmt: skip
    ax1.set_title("agreement with the target's greedy text")
    ax2.set_title("target log-likelihood per token")
    for ax in (ax1, ax2):
        ax.set_xlabel("disconnected after B tokens")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from benchmarks.testbed.report import add_out_argument, save_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", nargs="+", required=True)
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    add_out_argument(p, "remote_disconnect")
    p.add_argument("--after", type=int, nargs="+", default=[1, 10, 25, 50])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    rows = run(args)
    out = Path(args.out)
    save_json(out, "remote_disconnect", {"config": vars(args), "results": rows})
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
