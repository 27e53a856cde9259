"""`vllm serve` under load: throughput and latency against request rate, with vLLM's own client.

    python -m benchmarks.serve_sweep --target DIR --moa DIR [DIR ...] [--eagle DIR] \
        --prompts HumanEval.jsonl.gz --rates 0.5 1 2 inf \
        --out benchmarks/results/serve_sweep/serve_sweep.json

For each method (plain; each MoA drafter, with adaptive speculation length and with the fixed K
unless `--adaptive on|off`; vLLM's EAGLE on our exported EAGLE drafter) one
`vllm serve` at a time on a free loopback port, in vLLM's default (compiled) mode; for each
request rate, `vllm bench serve` (backend vllm, the held-out prompts as a custom dataset,
`--num-prompts` requests with `--max-tokens` output tokens each, ignore_eos, greedy, Poisson
arrivals, fixed seed: every method serves the same requests) reports output tokens/s and
TTFT / TPOT / end-to-end latency percentiles; acceptance (tau, per position) comes from the
server's own `/metrics` read around each rate. `--rounds N` sweeps the rates N times per server
and reports each figure's median (and each round's throughput); `--warmup N` runs N rounds
first, reported apart; `--interleave` starts every server at once and runs the arms in turn in
each round (forward, then backward), so drift hits them alike and each round gives a paired
ratio to plain (`rounds_vs_plain`, median `paired_vs_plain`). A MoA arm's row also keeps the
adaptive rule's last log line (its choices and fitted costs). Writes a JSON (config, git SHA,
machine, figures) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = re.compile(r'vllm:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spec_counts(base: str) -> dict[str, Any]:
    """The server's spec-decode counters (totals, and accepted tokens per position)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, Any] = {name: 0.0 for name in SPEC_COUNTERS}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in SPEC_COUNTERS:
            if line.startswith(name + "_total{") or line.startswith(name + "{"):
                out[name] += float(line.rsplit(" ", 1)[1])
        m = re.match(
            r'vllm:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)"', line
        )
        if m:
            per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0.0) + float(line.split()[-1])
    out["per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


class Server:
    def __init__(self, target: str, spec: dict[str, Any] | None, log: Path, max_len: int):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        vllm = Path(sys.executable).with_name("vllm")
        cmd = [
            str(vllm), "serve", target, "--served-model-name", "bench", "--host", "127.0.0.1",
            "--port", str(self.port), "--dtype", "float32", "--max-model-len", str(max_len),
            "--no-enable-prefix-caching",
        ]  # fmt: skip
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(2)
        self.stop()
        raise RuntimeError(f"vllm serve did not become healthy; log: {log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def bench(server: Server, args: argparse.Namespace, dataset: Path, rate: str, out: Path) -> dict:
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [
        str(vllm), "bench", "serve", "--backend", "vllm", "--base-url", server.base,
        "--model", "bench", "--tokenizer", args.target, "--dataset-name", "custom",
        "--dataset-path", str(dataset), "--custom-output-len", str(args.max_tokens),
        "--skip-chat-template", "--num-prompts", str(args.num_prompts),
        "--request-rate", rate, "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return dict(json.loads(out.read_text()))


ADAPTIVE = "MoA adaptive speculation:"


def _measure(
    server: Server, args: argparse.Namespace, dataset: Path, rate: str, out: Path
) -> dict[str, Any]:
    """One `vllm bench serve` run at `rate`: throughput, latencies, and the acceptance the
    server's counters moved by."""
    before = spec_counts(server.base)
    got = bench(server, args, dataset, rate, out)
    after = spec_counts(server.base)
    row: dict[str, Any] = {
        "output_tokens_per_s": got["output_throughput"],
        "e2e_latency_p50_ms": got["p50_e2el_ms"],
        "e2e_latency_p99_ms": got["p99_e2el_ms"],
        "ttft_p50_ms": got["p50_ttft_ms"],
        "tpot_p50_ms": got["p50_tpot_ms"],
        "completed": got["completed"],
    }
    drafts = after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]]
    if drafts:
        accepted = after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]]
        row["tau"] = 1 + accepted / drafts
        row["acceptance_per_position"] = [
            (a - b) / drafts for a, b in zip(after["per_pos"], before["per_pos"], strict=False)
        ]
    return row


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over rounds (the round whose throughput is the median gives the
    per-position acceptance)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, int | float) and all(key in r for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    middle = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
    if "acceptance_per_position" in middle:
        out["acceptance_per_position"] = middle["acceptance_per_position"]
    return out


def write_dataset(prompts_path: str, count: int, where: Path) -> Path:
    from benchmarks.testbed.evaluate import read_prompts

    path = where / "prompts.jsonl"
    prompts = read_prompts(Path(prompts_path), count)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    labels = list(dict.fromkeys(r["request_rate"] for r in rows))
    for i, method in enumerate(methods):
        mine = {r["request_rate"]: r for r in rows if r["method"] == method}
        xs = [j for j, rate in enumerate(labels) if rate in mine]
        axes[0].plot(
            xs, [mine[labels[j]]["output_tokens_per_s"] for j in xs], "o-", color=f"C{i}",
            label=method,
        )  # fmt: skip
        for key, style in (("e2e_latency_p50_ms", "o-"), ("e2e_latency_p99_ms", "x--")):
            label = f"{method} {key.split('_')[-2]}"
            values = [mine[labels[j]][key] for j in xs]
            axes[1].plot(xs, values, style, color=f"C{i}", label=label)
    titles = ("output tokens/s", "end-to-end latency p50 (o-) and p99 (x--), ms")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("request rate (requests/s; inf = all at once)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rows(
    runs: dict[str, dict[str, list[dict[str, Any]]]], logs: dict[str, Path], args: Any
) -> list[dict[str, Any]]:
    """One row per method and rate: the medians over the measured rounds (after the warm-up
    ones), each round's throughput, and each round's throughput over plain's in the same round
    (paired: what an interleaved run compares)."""
    rows: list[dict[str, Any]] = []
    for method, by_rate in runs.items():
        for rate, all_rounds in by_rate.items():
            measured = all_rounds[args.warmup :]
            row = {"method": method, "request_rate": rate, **_median(measured)}
            if args.rounds > 1:
                row["rounds_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in measured]
            if args.warmup:
                row["warmup_output_tokens_per_s"] = [
                    r["output_tokens_per_s"] for r in all_rounds[: args.warmup]
                ]
            plain = runs["plain"][rate][args.warmup :]
            row["throughput_vs_plain"] = row["output_tokens_per_s"] / statistics.median(
                r["output_tokens_per_s"] for r in plain
            )
            if args.interleave:
                paired = [
                    r["output_tokens_per_s"] / p["output_tokens_per_s"]
                    for r, p in zip(measured, plain, strict=True)
                ]
                row["rounds_vs_plain"] = paired
                row["paired_vs_plain"] = statistics.median(paired)
            rows.append(row)
        summary = [line for line in logs[method].read_text().splitlines() if ADAPTIVE in line]
        if summary:  # the adaptive rule's last report: its choices and fitted costs
            rows[-1]["adaptive_log"] = summary[-1].split(ADAPTIVE, 1)[1].strip()
    return rows


def main() -> None:
    from benchmarks.testbed.report import add_out_argument, save_json
    from benchmarks.throughput import vllm_eagle_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--moa", nargs="*", default=[], help="MoA drafter(s): one server each")
    p.add_argument("--eagle", default=None, help="EAGLE or EAGLE-3 drafter (ours or vLLM-format)")
    p.add_argument("--prompts", required=True, help="e.g. ../shared/data/HumanEval.jsonl.gz")
    add_out_argument(p, "serve_sweep")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rates", nargs="+", default=["0.5", "1", "2", "inf"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--rounds", type=int, default=1,
        help="sweep the rates this many times per server; each figure is the median over rounds",
    )  # fmt: skip
    p.add_argument(
        "--interleave", action="store_true",
        help="all servers up at once, the arms in turn in each round (forward, then backward): "
        "drift hits every arm alike, and each round gives paired ratios to plain",
    )  # fmt: skip
    p.add_argument(
        "--warmup", type=int, default=0,
        help="rounds run first and not counted in the medians (their throughput is kept): a "
        "fresh server's first burst compiles, and adaptive speculation learns its costs",
    )  # fmt: skip
    p.add_argument(
        "--adaptive", default="both", choices=["both", "on", "off"],
        help="MoA with adaptive speculation length (the default a user gets), with the fixed K "
        '("moa_adaptive": false; suffix _fixed), or both (one server each)',
    )  # fmt: skip
    args = p.parse_args()

    import vllm

    work = Path(tempfile.mkdtemp(prefix="serve_sweep_"))
    dataset = write_dataset(args.prompts, args.num_prompts, work)
    methods: dict[str, dict[str, Any] | None] = {"plain": None}
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.adaptive]
    for d in args.moa:
        name = Path(d).name if Path(d).name != "drafter" else Path(d).parent.name
        name = name if name.startswith("moa") else f"moa_{name}"
        for adaptive in modes:
            methods[name + ("" if adaptive else "_fixed")] = {
                "method": "moa", "model": d, "num_speculative_tokens": args.k,
                "moa_adaptive": adaptive,
            }  # fmt: skip
    if args.eagle:
        method, model = vllm_eagle_dir(args.eagle, args.target)
        methods[method] = {"method": method, "model": model, "num_speculative_tokens": args.k}
    if args.interleave:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # every server up at once
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    logs: dict[str, Path] = {}
    for group in [list(methods)] if args.interleave else [[m] for m in methods]:
        servers: dict[str, Server] = {}
        try:
            for method in group:
                logs[method] = work / f"{method}.log"
                servers[method] = Server(
                    args.target, methods[method], logs[method], args.max_model_len
                )
            for round_ in range(args.warmup + args.rounds):
                # Interleaved: the arms in turn, forward and backward in alternate rounds.
                for method in group if round_ % 2 == 0 else group[::-1]:
                    mine = runs.setdefault(method, {rate: [] for rate in args.rates})
                    for rate in args.rates:
                        result = work / f"{method}_{rate}_{round_}.json"
                        mine[rate].append(_measure(servers[method], args, dataset, rate, result))
                        print(method, rate, json.dumps(mine[rate][-1]), flush=True)
        finally:
            for server in servers.values():
                server.stop()
    rows = _rows(runs, logs, args)
    out = Path(args.out)
    config = {**vars(args), "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM")}}
    save_json(out, "serve_sweep", {"config": config, "vllm": vllm.__version__, "results": rows})
    _plot(out.with_suffix(".png"), rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
