"""The docs' generated tables: one layout per benchmark (`TABLES`), and the ones a marker may
name instead (`LAYOUTS`); each turns a results JSON into rows, the header first.
`benchmarks/results_index.py` places them between the docs' markers."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def short_level(level: str) -> str:
    """A hierarchy level's name in figures: `ngram` or its directory's last part."""
    return Path(level).name


def remote_name(r: dict[str, Any]) -> str:
    names = {"moa": f"MoA TLI={r.get('tli')}", "eagle": "EAGLE", "independent": "independent"}
    return names.get(r["kind"], "stop (API call)")


def _hsd(data: dict[str, Any]) -> Iterator[list[Any]]:
    yield ["arm", "stack (buffers)", "tok/s", "vs plain", "target calls/token",
           "ms/token measured", "ms/token predicted"]  # fmt: skip
    for r in data["results"]:
        stack = " -> ".join([*map(short_level, r["levels"]), "target"]) if r["levels"] else "plain"
        sizes = f" ({','.join(map(str, r['buffers']))})" if r["buffers"] else ""
        yield [
            r["arm"],
            stack + sizes,
            f"{r['tokens_per_s']:.1f}",
            f"{r['vs_plain']:.2f}",
            f"{r['target_calls_per_token']:.3f}",
            f"{r['measured_latency_s'] * 1e3:.2f}",
            f"{r['predicted_latency_s'] * 1e3:.2f}",
        ]


def _throughput(data: dict[str, Any]) -> Iterator[list[Any]]:
    yield ["batch", "method", "tok/s", "vs plain", "tau"]
    for r in sorted(data["results"], key=lambda r: r["batch_size"]):
        tau = f"{r['tau']:.2f}" if "tau" in r else ""
        yield [r["batch_size"], r["method"], f"{r['output_tokens_per_s']:.1f}",
               f"{r['speedup_vs_plain']:.2f}x", tau]  # fmt: skip


def _serve_sweep(data: dict[str, Any]) -> Iterator[list[Any]]:
    rows = data["results"]
    paired = all("paired_vs_plain" in r for r in rows)  # an interleaved run
    yield ["requests/s", "arm", "output tok/s", "vs plain",
           *(["paired vs plain (range)"] if paired else []), "TTFT p50 (ms)", "TPOT p50 (ms)",
           "latency p50 / p99 (s)", "tau"]  # fmt: skip
    rates = list(dict.fromkeys(r["request_rate"] for r in rows))
    plain = {r["request_rate"]: r["output_tokens_per_s"] for r in rows if r["method"] == "plain"}
    for rate in rates:
        for r in (r for r in rows if r["request_rate"] == rate):
            spread = (
                [
                    f"{r['paired_vs_plain']:.2f} ({min(r['rounds_vs_plain']):.2f}-"
                    f"{max(r['rounds_vs_plain']):.2f})"
                ]
                if paired
                else []
            )
            yield [
                "all at once" if rate == "inf" else rate,
                r["method"],
                f"{r['output_tokens_per_s']:.1f}",
                f"{r['output_tokens_per_s'] / plain[rate]:.2f}",
                *spread,
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['tpot_p50_ms']:.1f}",
                f"{r['e2e_latency_p50_ms'] / 1e3:.2f} / {r['e2e_latency_p99_ms'] / 1e3:.2f}",
                f"{r['tau']:.2f}" if "tau" in r else "",
            ]


def _standalone(data: dict[str, Any]) -> Iterator[list[Any]]:
    yield ["drafter", "mode", "tok/s", "vs plain", "tau"]
    for r in data["results"]:
        tau = f"{r['tau']:.2f}" if r.get("tau") else ""
        yield [Path(r["drafter"]).name, r["mode"], f"{r['tokens_per_s']:.1f}",
               f"{r['vs_plain']:.2f}x", tau]  # fmt: skip


def _remote_links(data: dict[str, Any]) -> Iterator[list[Any]]:
    yield ["drafter", "drafts", "link", "tok/s per client", "vs plain on server", "tau",
           "server calls / token", "bytes up / token", "bytes down / token"]  # fmt: skip
    for r in data["results"]:
        yield [remote_name(r), r["mode"], r["profile"], f"{r['tokens_per_s']:.1f}",
               f"{r['tokens_per_s'] / r['plain_server_tokens_per_s']:.2f}x", f"{r['tau']:.2f}",
               f"{r['server_calls_per_token']:.3f}", f"{r['bytes_up_per_token']:.0f}",
               f"{r['bytes_down_per_token']:.0f}"]  # fmt: skip


def _remote_capacity(data: dict[str, Any]) -> Iterator[list[Any]]:
    yield ["clients", "server tok/s: client-server", "target alone", "ratio",
           "tok/s per client: client-server", "target alone"]  # fmt: skip
    for r in data["results"]:
        s, t = r["speculative"], r["target_alone"]
        yield [r["clients"], f"{s['server_tokens_per_s']:.1f}",
               f"{t['server_tokens_per_s']:.1f}", f"{r['ratio']:.2f}x",
               f"{s['client_tokens_per_s']:.1f}", f"{t['client_tokens_per_s']:.1f}"]  # fmt: skip


def _remote_disconnect(data: dict[str, Any]) -> Iterator[list[Any]]:
    yield ["drafter", "lost after B", "verified tokens", "written alone",
           "target log-lik / token", "agreement with target", "common prefix"]  # fmt: skip
    for r in sorted(data["results"], key=lambda r: r["after"]):
        ll = f"{r['loglik_per_token']:.2f}" if r["loglik_per_token"] is not None else "-"
        yield [remote_name(r), r["after"], f"{r['verified_tokens']:.1f}",
               f"{r['written_alone']:.1f}", ll, f"{r['agreement']:.3f}",
               f"{r['common_prefix']:.1f}"]  # fmt: skip


def _draft_cost(data: dict[str, Any]) -> Iterator[list[Any]]:
    rows = data["results"]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    by = {(r["method"], r["prompt_tokens"]): r for r in rows}
    names = {
        "moa": "MoA",
        "moa_eager": "MoA eager",
        "eagle": "vLLM EAGLE",
        "eagle3": "vLLM EAGLE-3",
    }
    wall = "wall ms/token: " + " / ".join(["plain", *(names.get(m, m) for m in methods)])
    paired = "eagle" in methods  # the MoA / EAGLE column only where EAGLE ran
    ratio_column = ["MoA / EAGLE (median of rounds)"] if paired else []
    yield ["prompt tokens", *(f"{names.get(m, m)} drafting ms/token" for m in methods),
           *ratio_column, wall]  # fmt: skip
    for length in dict.fromkeys(r["prompt_tokens"] for r in rows):
        moa = by.get(("moa", length), {})
        ratio = [f"{moa['propose_vs_eagle']:.2f}" if "propose_vs_eagle" in moa else ""]
        walls = [
            by[(m, length)]["wall_ms_per_token"] for m in ["plain", *methods] if (m, length) in by
        ]
        yield [length, *(f"{by[(m, length)]['propose_ms_per_token']:.2f}" for m in methods),
               *(ratio if paired else []), " / ".join(f"{w:.2f}" for w in walls)]  # fmt: skip


def _serve_sweep_compact(data: dict[str, Any]) -> Iterator[list[Any]]:
    """One row per rate, one column per arm: throughput vs plain (the median of the paired
    rounds' ratios where the run interleaved the arms), median latency (s)."""
    rows = data["results"]
    arms = list(dict.fromkeys(r["method"] for r in rows))
    names = {"plain": "plain", "eagle": "vLLM EAGLE (fixed K)"}
    label = {a: names.get(a, "MoA fixed K" if a.endswith("_fixed") else "MoA adaptive (default)")
             for a in arms}  # fmt: skip
    yield ["requests/s", *(label[a] for a in arms)]
    plain = {r["request_rate"]: r["output_tokens_per_s"] for r in rows if r["method"] == "plain"}
    by = {(r["request_rate"], r["method"]): r for r in rows}
    for rate in dict.fromkeys(r["request_rate"] for r in rows):
        cells = []
        for a in arms:
            r = by[(rate, a)]
            ratio = r.get("paired_vs_plain", r["output_tokens_per_s"] / plain[rate])
            cells.append(f"{ratio:.2f}, {r['e2e_latency_p50_ms'] / 1e3:.2f}")
        yield ["all at once" if rate == "inf" else rate, *cells]


TESTBED_NAMES = {
    "moa_tli0": "MoA TLI=0",
    "moa_tli1": "MoA TLI=1",
    "moa_no_lsa": "MoA without LSA",
    "eagle": "EAGLE",
    "independent": "independent",
    "griffin": "GRIFFIN drafter (TGF)",
    "eagle3": "EAGLE-3",
}
SEED = re.compile(r"^(?P<method>.+)_s(?P<seed>\d+)$")


ALIGNED = re.compile(r"^(?P<method>.+)_a(?P<steps>\d+)(?:t(?P<topk>\d+))?$")


def _testbed_name(method: str) -> str:
    for suffix, words in (
        ("_slim", ", slim LSA"),
        ("_k3_8", ", K ~ U[3, 8]"),
        ("_k4_9", ", K ~ U[4, 9]"),
        ("_stairrelease", ", staircase (release)"),
        ("_stairhalf", ", staircase (half)"),
        ("_carelease", ", CA mask (release)"),
        ("_normnormal", ", norms N(0, 0.02)"),
    ):
        if method.endswith(suffix):
            return _testbed_name(method[: -len(suffix)]) + words
    aligned = ALIGNED.match(method)
    if aligned:  # token-aligned training (GRIFFIN's): N passes, top-k mask
        topk = f", top-{aligned['topk']}" if aligned["topk"] else ""
        return f"{_testbed_name(aligned['method'])} + alignment ({aligned['steps']} passes{topk})"
    return TESTBED_NAMES.get(method, method)


def testbed_rows(runs: list[dict[str, Any]]) -> Iterator[list[Any]]:
    """Greedy tau per drafter: chains of K=4 and K=6 and trees, the mean over seeds (each seed
    in parentheses when there are several), and the ratios to EAGLE's means."""
    taus: dict[str, dict[str, dict[int, float]]] = {}  # method -> setting -> seed -> tau
    for data in runs:
        seed0 = int((data.get("config") or {}).get("drafter_seed") or 0)
        for key, settings in data["results"].items():
            if key == "plain":
                continue
            match = SEED.match(key)
            method, seed = (match["method"], int(match["seed"])) if match else (key, seed0)
            for setting, r in settings.items():
                if isinstance(r, dict) and "tau" in r:
                    taus.setdefault(method, {}).setdefault(setting, {})[seed] = r["tau"]
    columns = sorted({s for m in taus.values() for s in m}, key=lambda s: (s.startswith("t"), s))

    def mean(method: str, setting: str) -> float | None:
        seeds = taus.get(method, {}).get(setting)
        return sum(seeds.values()) / len(seeds) if seeds else None

    def title(setting: str) -> str:
        if setting.startswith("k"):
            return f"tau, K={setting[1:]}"
        depth, breadth, budget = (int(x[1:]) for x in setting.split("_")[1:])
        return f"trees ({depth}, {breadth}, {budget})"

    yield ["drafter", "seeds", *map(title, columns), "x EAGLE"]
    for method, settings in taus.items():
        seeds = sorted({seed for by in settings.values() for seed in by})
        cells = []
        for setting in columns:
            m, by = mean(method, setting), settings.get(setting, {})
            cell = "" if m is None else f"{m:.2f}"
            if m is not None and len(by) > 1:
                cell += " (" + ", ".join(f"{by[s]:.2f}" for s in sorted(by)) + ")"
            cells.append(cell)
        ratios = []
        for setting in columns:
            m, e = mean(method, setting), mean("eagle", setting)
            ratios.append(f"{m / e:.2f}" if m is not None and e else "-")
        yield [_testbed_name(method), ", ".join(map(str, seeds)), *cells,
               "1" if method == "eagle" else " / ".join(ratios)]  # fmt: skip


_ARM_NAMES = {
    "moa_k4": "MoA, K=4",
    "moa_k4_adaptive": "MoA, adaptive up to K=4 (default)",
    "eagle_k4": "vLLM EAGLE, K=4",
    "eagle3_k4": "vLLM EAGLE-3, K=4",
    "ngram_k4": "vLLM ngram, K=4",
}


def _throughput_compact(data: dict[str, Any]) -> Iterator[list[Any]]:
    """One row per batch size, one column per method: speed-up over plain (ratio of the
    medians) and tau."""
    rows = data["results"]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    yield ["batch", "plain tok/s", *(_ARM_NAMES.get(m, m) for m in methods)]
    for batch in sorted({r["batch_size"] for r in rows}):
        at = {r["method"]: r for r in rows if r["batch_size"] == batch}
        cells = []
        for m in methods:
            r = at.get(m)
            tau = f", tau {r['tau']:.2f}" if r is not None and "tau" in r else ""
            cells.append("" if r is None else f"{r['speedup_vs_plain']:.2f}x{tau}")
        yield [batch, f"{at['plain']['output_tokens_per_s']:.1f}", *cells]


def _paired(data: dict[str, Any]) -> Iterator[list[Any]]:
    """Each MoA arm against the other arms, round by round (`throughput.paired_ratios`)."""
    yield ["batch", "MoA arm", "against", "median of paired ratios", "90% interval of the median"]
    for r in sorted(data["results"], key=lambda r: r["batch_size"]):
        for other, p in r.get("paired", {}).items():
            low, high = p["interval_90"]
            yield [r["batch_size"], _ARM_NAMES.get(r["method"], r["method"]),
                   _ARM_NAMES.get(other, other), f"{p['median']:.2f}",
                   f"{low:.2f}-{high:.2f}"]  # fmt: skip


def _draft_profile(data: dict[str, Any]) -> Iterator[list[Any]]:
    """A draft phase's parts per arm (ms, medians over decode steps) and c."""
    rows = [r for r in data["results"] if r["arm"] != "plain"]
    parts = list(dict.fromkeys(p for r in rows for p in r["parts_ms"]))
    whole = all("request_ms" in r for r in rows)  # per-request figures: newer runs only
    extra = ["prefill step (its rows)", "decode steps / request", "request"] if whole else []
    yield ["arm", "target step (verify)", "draft phase", *parts, "draft step", "c", *extra]
    for r in rows:
        cells = [f"{r['parts_ms'][p]:.2f}" if p in r["parts_ms"] else "" for p in parts]
        rows_in = f" ({r['prefill_rows_ms']:.1f})" if r.get("prefill_rows_ms") else ""
        cells_whole = [f"{r['prefill_step_ms']:.1f}{rows_in}", f"{r['steps_per_request']:.1f}",
                       f"{r['request_ms']:.0f}"] if whole else []  # fmt: skip
        yield [r["arm"], f"{r['target_step_ms']:.1f}", f"{r['draft_phase_ms']:.1f}", *cells,
               f"{r['draft_step_ms']:.2f}", f"{r['c']:.3f}", *cells_whole]  # fmt: skip


def _compact(data: dict[str, Any]) -> Iterator[list[Any]]:
    if data.get("benchmark") == "throughput":
        return _throughput_compact(data)
    return _serve_sweep_compact(data)


# Layouts a marker may name after the results file (`<!-- results-table: NAME LAYOUT -->`).
LAYOUTS: dict[str, Callable[[dict[str, Any]], Iterator[list[Any]]]] = {
    "compact": _compact,
    "paired": _paired,
}

TABLES: dict[str, Callable[[dict[str, Any]], Iterator[list[Any]]]] = {
    "draft_cost": _draft_cost,
    "draft_profile": _draft_profile,
    "throughput": _throughput,
    "serve_sweep": _serve_sweep,
    "standalone_adaptive": _standalone,
    "hsd": _hsd,
    "remote_links": _remote_links,
    "remote_capacity": _remote_capacity,
    "remote_disconnect": _remote_disconnect,
    "testbed": lambda data: testbed_rows([data]),
}


def markdown(rows: list[list[Any]]) -> str:
    header, *body = rows
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in body]
    return "\n".join(lines) + "\n"
