"""Server capacity under client-server speculative decoding: 1 to 32 concurrent clients.

    python -m benchmarks.remote_capacity --target DIR --drafter DIR \
        --prompts ../shared/data/HumanEval.jsonl.gz \
        --out benchmarks/results/remote/remote_capacity.json

What a server operator asks: how many tokens/s does one server give in total, and each client,
as clients are added; and where does it stop beating the target alone serving the same clients.

Clients are devices, so their drafting must not use the server's CPU. Each prompt is therefore
first decoded once by a real client (`RemoteClient`) that records, per cycle, the draft it sent
and how long drafting took on this machine; then B clients replay those recordings concurrently
(asyncio, one connection each, over `--profile`'s emulated link): each sleeps its recorded
drafting time, sends the recorded draft, and checks the server's answer equals the recorded one
(greedy, so it must). The server (`vllm-moa remote-server`, its own process) batches their
verifications. "Target alone" is the same server machine decoding the same B prompts plainly,
continuously batched (one pass per token for every unfinished prompt), with no link: an API
server's rate. Writes a JSON (config, git SHA, machine, figures) and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Recording:
    prompt: list[int]
    start: bytes  # the START frame
    cycles: list[tuple[float, bytes]] = field(default_factory=list)  # drafting s, DRAFT frame
    tokens: int = 0


def record(args: argparse.Namespace, address: str, prompts: list[list[int]]) -> list[Recording]:
    from vllm_moa.decoding.tree import DraftTree, TreeParams
    from vllm_moa.remote import protocol
    from vllm_moa.remote.client import RemoteClient

    client = RemoteClient(address, args.target, args.drafter)
    tree = TreeParams(*args.tree) if args.tree else None
    out = []
    for ids in prompts:
        rec = Recording(ids, b"")
        drafts: list[tuple[float, DraftTree]] = []
        original = client._draft

        def timed(*a: Any, _orig: Any = original, _drafts: Any = drafts) -> DraftTree:
            began = time.perf_counter()
            d = _orig(*a)
            _drafts.append((time.perf_counter() - began, d))
            return d

        client._draft = timed  # type: ignore[method-assign,assignment]
        result = client.generate(ids, args.max_tokens, num_speculative_tokens=args.k, tree=tree)
        client._draft = original  # type: ignore[method-assign]
        rec.start = protocol.frame(protocol.Start(ids, args.max_tokens, client.fingerprint))
        for cycle, (wait, d) in enumerate(drafts):
            rec.cycles.append((wait, protocol.frame(protocol.Draft(cycle, d.tokens, d.parents))))
        rec.tokens = len(result.token_ids)
        out.append(rec)
    return out


async def replay(address: tuple[str, int], rec: Recording) -> tuple[float, int]:
    """One client: returns (seconds, tokens)."""
    from vllm_moa.remote import protocol

    began = time.perf_counter()
    reader, writer = await asyncio.open_connection(*address)
    writer.write(rec.start)
    await writer.drain()
    reply = protocol.decode(await protocol.read_frame(reader))
    assert isinstance(reply, protocol.Started), reply
    tokens = 1
    for wait, frame in rec.cycles:
        await asyncio.sleep(wait)  # the device drafting
        writer.write(frame)
        await writer.drain()
        answer = protocol.decode(await protocol.read_frame(reader))
        assert isinstance(answer, protocol.Verified), answer
        tokens += len(answer.accepted) + 1
        if answer.finish is not protocol.Finish.NONE:
            break
    writer.write(protocol.frame(protocol.Close()))
    writer.close()
    if tokens != rec.tokens:
        raise AssertionError(f"replay produced {tokens} tokens, the recording {rec.tokens}")
    return time.perf_counter() - began, tokens


async def replay_many(address: tuple[str, int], recs: list[Recording]) -> dict[str, Any]:
    began = time.perf_counter()
    runs = await asyncio.gather(*(replay(address, r) for r in recs))
    span = time.perf_counter() - began
    total = sum(t for _, t in runs)
    return {
        "server_tokens_per_s": total / span,
        "client_tokens_per_s": statistics.median(t / s for s, t in runs),
    }


class _NoRows:
    """The server half of no drafter: the target alone."""

    hidden_layers: tuple[int, ...] = ()

    def rows(self, verified: Any, positions: Any) -> list[torch.Tensor]:
        return []


def target_alone(target_dir: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.remote import protocol
    from vllm_moa.remote.verifier import Verifier

    target = HFTarget.from_pretrained(target_dir)
    v = Verifier(target, _NoRows(), b"\0" * 8, [])  # type: ignore[arg-type]
    began = time.perf_counter()
    sessions = []
    for ids in prompts:
        s = v.open(protocol.Start(ids, max_tokens, b"\0" * 8))
        v.prefill(s, ids)
        sessions.append(s)
    while live := [s for s in sessions if s.finish is protocol.Finish.NONE]:
        v.verify([(s, protocol.Draft(s.cycle, [], [])) for s in live])
    span = time.perf_counter() - began
    total = sum(len(s.generated) for s in sessions)
    return {"server_tokens_per_s": total / span, "client_tokens_per_s": total / span / len(prompts)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from benchmarks.link_emulator import PROFILES, open_links
    from benchmarks.remote_links import _start_server
    from benchmarks.testbed.evaluate import read_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = read_prompts(Path(args.prompts), max(args.clients))
    prompts = [tokenizer(p)["input_ids"] for p in texts]
    links, why = open_links(args.link)
    print(f"links: {links.kind}" + (f" ({why})" if why else ""), flush=True)
    proc, port = _start_server(args.target, args.drafter, links)
    rows = []
    try:
        torch.set_num_threads(1)
        recs = record(args, f"{links.server_host}:{port}", prompts)
        torch.set_num_threads(2)
        relay = links.client_address(PROFILES[args.profile], port)
        for b in args.clients:
            spec = asyncio.run(replay_many(relay, recs[:b]))
            row = {"clients": b, "speculative": spec, "link": links.kind}
            rows.append(row)
            print(row, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
        links.close()
    for row in rows:
        b = row["clients"]
        row["target_alone"] = target_alone(args.target, prompts[:b], args.max_tokens)
        row["ratio"] = (
            row["speculative"]["server_tokens_per_s"] / row["target_alone"]["server_tokens_per_s"]
        )
        print(row, flush=True)
    return rows


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = [r["clients"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for key, label in (("speculative", "client-server MoA"), ("target_alone", "target alone")):
        ax1.plot(b, [r[key]["server_tokens_per_s"] for r in rows], "o-", label=label)
        ax2.plot(b, [r[key]["client_tokens_per_s"] for r in rows], "o-", label=label)
    for ax, title in ((ax1, "server tokens/s"), (ax2, "tokens/s per client")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from benchmarks.testbed.report import add_out_argument, save_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    add_out_argument(p, "remote_capacity")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--profile", default="unconstrained", choices=["unconstrained", "5g", "4g"])
    p.add_argument("--link", choices=["auto", "netem", "relay"], default="auto")
    p.add_argument("--k", type=int, default=4, help="chain length")
    p.add_argument("--tree", type=int, nargs=3, default=None, metavar=("D", "B", "M"))
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    rows = run(args)
    out = Path(args.out)
    save_json(out, "remote_capacity", {"config": vars(args), "results": rows})
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
