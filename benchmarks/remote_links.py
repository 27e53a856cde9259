"""Client-server speculative decoding over emulated links (the MoA paper's Table 3 analogue).

    python -m benchmarks.remote_links --target DIR --drafter DIR [DIR ...] \
        --prompts ../shared/data/HumanEval.jsonl.gz \
        --out benchmarks/results/remote/remote_links_cpu.json

One `vllm-moa remote-server` process per drafter (the target's side), the client in this
process through `benchmarks/link_emulator.py` (this kernel has no `tc netem`: see there), for
each link profile (`--profiles`: unconstrained, 5g, 4g) and decoding mode (chains of K, EAGLE-2
trees). Per (drafter, mode, profile): tokens/s per client (median over prompts), tau, server
calls per token, bytes up / down per token, and the same prompts decoded plainly by the target on
the server machine (the vanilla single-device rate the paper compares with). Greedy; the outputs
are checked against plain decoding. Writes a JSON (config, git SHA, machine, figures) and a PNG.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(target: str, drafter: str, links: Any) -> tuple[subprocess.Popen[str], int]:
    """`vllm-moa remote-server` where `links` (link_emulator.Links) wants it."""
    port, host = _free_port(), links.server_host
    cmd = [*links.server_prefix, sys.executable, "-m", "vllm_moa.cli.main", "remote-server"]
    cmd += ["--target", target, "--drafter", drafter, "--host", host, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("remote-server did not start")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoTokenizer

    from benchmarks.link_emulator import PROFILES, open_links
    from benchmarks.testbed.evaluate import read_prompts
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.decoding.tree import TreeParams
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.remote.client import RemoteClient

    os.environ.setdefault("VLLM_MOA_ADAPTIVE", "0")
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [
        tokenizer(p)["input_ids"] for p in read_prompts(Path(args.prompts), args.num_prompts)
    ]
    plain_engine = SpeculativeEngine(HFTarget.from_pretrained(args.target))
    plain_ids, plain_tps = [], []
    for ids in prompts:
        done = plain_engine.generate(ids, args.max_tokens)
        plain_ids.append(done.token_ids)
        plain_tps.append(done.stats.tokens_per_second)
    base = statistics.median(plain_tps)  # with all cores, as the server process has them
    torch.set_num_threads(1)  # the client drafts on one core: a device slower than the server
    print(f"plain on the server machine: {base:.1f} tok/s", flush=True)
    modes: dict[str, TreeParams | None] = {"chain": None}
    if args.tree:
        modes["tree"] = TreeParams(*args.tree)
    rows: list[dict[str, Any]] = []
    links, why = open_links(args.link)
    print(f"links: {links.kind}" + (f" ({why})" if why else ""), flush=True)
    for drafter in args.drafter:
        proc, port = _start_server(args.target, drafter, links)
        try:
            for profile_name in args.profiles:
                host, relay_port = links.client_address(PROFILES[profile_name], port)
                address = f"{host}:{relay_port}"
                client = RemoteClient(address, args.target, drafter)
                client.generate(prompts[0], 8)  # warm-up
                for mode, tree in modes.items():
                    results = []
                    for ids, want in zip(prompts, plain_ids, strict=True):
                        r = client.generate(
                            ids, args.max_tokens, num_speculative_tokens=args.k, tree=tree
                        )
                        if r.token_ids != want:
                            raise AssertionError(f"{drafter} {mode}: output differs from plain")
                        results.append(r)
                    tokens = sum(len(r.token_ids) for r in results)
                    row = {
                        "drafter": drafter,
                        "kind": client.kind,
                        "tli": client.tli,
                        "mode": mode,
                        "profile": profile_name,
                        "tokens_per_s": statistics.median(r.tokens_per_second for r in results),
                        "tokens_per_s_all": [r.tokens_per_second for r in results],
                        "tau": 1
                        + sum(r.accepted_tokens for r in results)
                        / max(1, sum(r.cycles for r in results)),
                        "server_calls_per_token": sum(r.server_calls for r in results) / tokens,
                        "bytes_up_per_token": sum(r.bytes_up for r in results) / tokens,
                        "bytes_down_per_token": sum(r.bytes_down for r in results) / tokens,
                        "plain_server_tokens_per_s": base,
                        "link": links.kind,
                    }
                    rows.append(row)
                    print({k: v for k, v in row.items() if k != "tokens_per_s_all"}, flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    links.close()
    return rows


def _label(row: dict[str, Any]) -> str:
    name = {"moa": f"MoA TLI={row['tli']}", "eagle": "EAGLE", "independent": "independent"}
    return f"{name[row['kind']]} {row['mode']}"


def _plot(path: Path, rows: list[dict[str, Any]], profiles: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(_label(r) for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(profiles)
    for j, prof in enumerate(profiles):
        values = [
            next((r["tokens_per_s"] for r in rows if _label(r) == lab and r["profile"] == prof), 0)
            for lab in labels
        ]
        ax.bar([i + j * width for i in range(len(labels))], values, width, label=prof)
    ax.axhline(rows[0]["plain_server_tokens_per_s"], color="grey", lw=0.8, label="plain, on server")
    ax.set_xticks([i + width for i in range(len(labels))], labels, rotation=20, ha="right")
    ax.set_ylabel("tokens/s per client")
    ax.set_title("client-server speculative decoding over emulated links")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from benchmarks.testbed.report import add_out_argument, save_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", nargs="+", required=True, help="one server each")
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    add_out_argument(p, "remote_links")
    p.add_argument("--profiles", nargs="+", default=["unconstrained", "5g", "4g"])
    p.add_argument(
        "--link",
        choices=["auto", "netem", "relay"],
        default="auto",
        help="tc netem in network namespaces (root, iproute2, sch_netem) or the userspace relay; "
        "auto: netem where it works",
    )
    p.add_argument("--k", type=int, default=4, help="chain length")
    p.add_argument("--tree", type=int, nargs=3, default=[5, 4, 24], metavar=("D", "B", "M"))
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    rows = run(args)
    out = Path(args.out)
    save_json(out, "remote_links", {"config": vars(args), "results": rows})
    _plot(out.with_suffix(".png"), rows, args.profiles)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
