"""One machine-readable index of the benchmark results, a readable one, and the docs' tables
generated from them.

    python -m benchmarks.results_index            # rewrite benchmarks/results/index.jsonl,
                                                  # benchmarks/results/README.md and every
                                                  # generated table in the docs
    python -m benchmarks.results_index --check    # exit 1 if any is stale, or if a results file
                                                  # records a machine path (a test runs this)

Results live in one folder per benchmark (`benchmarks/results_paths.py`). `index.jsonl` has one
row per results file: the file (relative to benchmarks/results/), the benchmark, the date, the
git SHA and machine it ran on, the command, its configuration (scalar settings; lists joined) and
its key figures (`figures`: a flat name -> number map, e.g. `moa_k4_adaptive@b16` -> speed-up
over plain). `README.md` lists the same rows by folder, for reading.

A table in a markdown file is generated when it sits between two markers naming a results file by
its stem (unique across the folders):

    <!-- results-table: serve_sweep_cpu_inflated -->
    | ... generated ... |
    <!-- /results-table -->

The table's columns follow the benchmark (`benchmarks/results_tables.py`); prose around it stays
hand-written. A testbed table may merge several runs:
`<!-- results-table: testbed_cpu,testbed_cpu_tree -->` (one row per drafter; a later file's
figures win; drafters of other seeds, `<method>_s<S>`, share their method's row: the mean, then
each seed's value).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.results_paths import (
    RESULTS,
    ROOT,
    find,
    folder,
    machine_paths,
    results_files,
    shell_join,
)
from benchmarks.results_tables import (
    LAYOUTS,
    TABLES,
    markdown,
    remote_name,
    short_level,
    testbed_rows,
)

INDEX = RESULTS / "index.jsonl"
README = RESULTS / "README.md"
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "testbed" / "README.md",
]
MARKER = re.compile(
    r"(<!-- results-table: (?P<name>[\w.,-]+)(?: (?P<layout>[\w-]+))? -->\n)(?P<body>.*?)"
    r"(<!-- /results-table -->)",
    re.S,
)


def _num(x: Any, digits: int = 3) -> Any:
    return round(x, digits) if isinstance(x, float) else x


def _figures(data: dict[str, Any]) -> dict[str, Any]:
    """The key figures of one results file, by benchmark."""
    kind = data.get("benchmark")
    rows: Any = data.get("results") or []
    out: dict[str, Any] = {}
    if kind == "throughput":
        for r in rows:
            out[f"{r['method']}@b{r['batch_size']}"] = _num(r["speedup_vs_plain"])
    elif kind == "serve_sweep":
        plain = {
            r["request_rate"]: r["output_tokens_per_s"] for r in rows if r["method"] == "plain"
        }
        for r in rows:
            rate = r["request_rate"]
            out[f"{r['method']}@{rate}"] = _num(r["output_tokens_per_s"] / plain[rate])
    elif kind == "standalone_adaptive":
        for r in rows:
            out[f"{Path(r['drafter']).name}/{r['mode']}"] = _num(r["vs_plain"])
    elif kind == "remote_links":
        for r in rows:
            out[f"{remote_name(r)}/{r['mode']}@{r['profile']}"] = _num(r["tokens_per_s"])
    elif kind == "remote_capacity":
        for r in rows:
            out[f"clients{r['clients']}"] = _num(r["ratio"])
    elif kind == "remote_disconnect":
        for r in rows:
            out[f"{remote_name(r)}@{r['after']}"] = _num(r["agreement"])
    elif kind == "draft_cost":
        for r in rows:
            if r["method"] != "plain":
                out[f"{r['method']}@{r['prompt_tokens']}"] = _num(r["propose_ms_per_token"])
            if "propose_vs_eagle" in r:
                out[f"moa/eagle@{r['prompt_tokens']}"] = _num(r["propose_vs_eagle"])
    elif kind == "rule_overhead":
        for r in rows:
            out[f"{r['arm']}@b{r['batch']}/us"] = _num(r["us_per_step"])
    elif kind == "cold_start":
        for r in rows:
            out[f"{r['arm']}/vs_plain"] = _num(r["speedup"])
    elif kind == "draft_profile":
        for r in rows:
            if "c" in r:
                out[f"{r['arm']}/c"] = _num(r["c"])
    elif kind == "hsd":
        for r in rows:
            out[f"{'+'.join(map(short_level, r['levels'])) or 'plain'}"] = _num(r["vs_plain"])
            out[f"{'+'.join(map(short_level, r['levels'])) or 'plain'}/measured_over_predicted"] = (
                _num(r["measured_latency_s"] / r["predicted_latency_s"])
            )
    elif kind == "testbed":
        for method, r in rows.items():
            for k, v in r.items() if method != "plain" else []:
                if isinstance(v, dict) and "tau" in v:
                    out[f"{method}@{k}"] = _num(v["tau"])
    return out


def _config(data: dict[str, Any]) -> dict[str, Any]:
    config = data.get("config") or {}
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in sorted(config.items()):
        if isinstance(value, list):
            value = " ".join(map(str, value))
        if value is None or isinstance(value, str | int | float | bool):
            out[key] = value
    if "preset" in data and isinstance(data["preset"], str):
        out.setdefault("preset", data["preset"])
    return out


# -- commands ---------------------------------------------------------------------------------

# The module a benchmark runs as, where it is not `benchmarks.<benchmark>`.
MODULES = {"kernels": "kernels_gpu"}
# A config key recorded under another name than its flag.
FLAG_NAMES = {("positions", "drafters"): "--drafter"}
# The flag naming the results file, where it is not --out (the testbed's --out is a work dir).
RESULTS_FLAG = {"testbed": "--results"}
# Values a run made itself (draft_cost's random drafters, under its own temporary directory).
MADE_BY_THE_RUN = re.compile(r"^\$TMPDIR/draft_cost_")


def _flags(module: str) -> tuple[set[str], set[str]]:
    """The flags the benchmark's argument parser declares, and which of them are required."""
    for source in (
        ROOT / "benchmarks" / f"{module}.py",
        ROOT / "benchmarks" / module / "__main__.py",
    ):
        if source.is_file():
            break
    else:
        return set(), set()
    flags, required = set(), set()
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute | ast.Name):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        if name == "add_out_argument":
            flags.add("--out")
        elif name == "add_argument" and node.args and isinstance(node.args[0], ast.Constant):
            flag = str(node.args[0].value)
            flags.add(flag)
            if any(k.arg == "required" and getattr(k.value, "value", None) for k in node.keywords):
                required.add(flag)
    return flags, required


def command(data: dict[str, Any], path: Path) -> tuple[str | None, str]:
    """The run's command and where it comes from: "recorded"; else "reconstructed" from the
    recorded config (a flag per key, the results flag naming the file where it now lies);
    else "not recorded" (no config, or the config lacks a required flag)."""
    if isinstance(data.get("command"), str):
        return data["command"], "recorded"
    benchmark, config = str(data.get("benchmark")), data.get("config")
    module = MODULES.get(benchmark, benchmark)
    flags, required = _flags(module)
    if not isinstance(config, dict) or not flags:
        return None, "not recorded"
    out = RESULTS_FLAG.get(benchmark, "--out")
    words = [f"{k}={v}" for k, v in (config.get("env") or {}).items()]
    words += ["python", "-m", f"benchmarks.{module}"]
    given = {out}
    for key, value in config.items():
        flag = FLAG_NAMES.get((benchmark, key), "--" + key.replace("_", "-"))
        values = value if isinstance(value, list) else [value]
        if flag in given or flag not in flags or value in (None, False, []):
            continue
        if any(isinstance(v, str) and MADE_BY_THE_RUN.match(v) for v in values):
            continue
        given.add(flag)
        words += [flag] if value is True else [flag, *map(str, values)]
    missing = sorted(required - given)
    if missing:
        return None, f"not recorded (the config has no {', '.join(missing)})"
    return shell_join([*words, out, str(path.relative_to(ROOT))]), "reconstructed"


# -- the index ---------------------------------------------------------------------------------


def index_rows() -> list[dict[str, Any]]:
    rows = []
    for path in results_files():
        data = json.loads(path.read_text())
        machine = data.get("machine") or {}
        text, source = command(data, path)
        rows.append(
            {
                "file": path.relative_to(RESULTS).as_posix(),
                "benchmark": data.get("benchmark"),
                "date": data.get("date"),
                "git_sha": data.get("git_sha"),
                "machine": {
                    k: machine.get(k)
                    for k in ("cpu_count", "torch", "gpu", "platform")
                    if k in machine
                },
                "command": text,
                "command_from": source,
                "config": _config(data),
                "figures": _figures(data),
            }
        )
    return rows


def render_index(rows: list[dict[str, Any]] | None = None) -> str:
    rows = index_rows() if rows is None else rows
    return "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)


# What each benchmark measures (README.md's headings).
MEASURES = {
    "throughput": "vLLM offline throughput, plain vs MoA (and vLLM's EAGLE, ngram) per batch size",
    "serve_sweep": "`vllm serve` under load: throughput and latency against request rate",
    "testbed": "tau of drafters trained against the project's small Llama target (greedy, "
    "chains and trees); each run's command and findings: [testbed/README.md](../testbed/README.md)",
    "standalone_adaptive": "the standalone engine: plain vs fixed-K vs adaptive speculation",
    "remote_links": "client-server speculative decoding over emulated 5G / 4G links",
    "remote_capacity": "server capacity with 1 to 32 concurrent client-server clients",
    "remote_disconnect": "what a client writes alone after losing its server",
    "draft_cost": "drafting cost inside vLLM per generated token against context length",
    "draft_profile": "a draft phase inside vLLM split into its parts: MoA vs vLLM's EAGLE(-3)",
    "rule_overhead": "adaptive speculation's host time a step against the batch size (no model)",
    "cold_start": "adaptive speculation after a start-up beside CPU burners, vs fixed K and plain",
    "hsd": "hierarchical speculative decoding: the planner's stack vs single drafters",
    "kernels_aot": "the Triton kernels compiled for sm_90 / sm_80 without a GPU: resources",
    "kernels": "the Triton kernels' correctness and timing on a GPU",
    "memory_ablation": "what the Cross-Attention memory should hold (teacher-forced agreement)",
    "positions": "per-position agreement and acceptance of drafted tokens",
    "sampling_check": "whether speculative sampling through vLLM is lossless",
    "tree_path": "a drafter-side tree search for chain-only verifiers",
    "cost_model": "a speculative cycle's parts timed at Llama-3-8B shapes, speed-ups projected",
    "gpu_check": "the GPU check ([docs/gpu.md](../../docs/gpu.md))",
}
# The config keys README.md shows for a testbed run (the rest are the preset's).
TESTBED_KEYS = ("preset", "num_layers", "hidden_size", "num_kv_heads", "corpus_bytes",
                "target_steps", "drafter_steps", "drafter_seed", "moa_refresh", "align_steps",
                "eval_prompts", "ks")  # fmt: skip


def _machine_words(machine: dict[str, Any]) -> str:
    where = machine.get("gpu") or (f"CPU x{machine['cpu_count']}" if "cpu_count" in machine else "")
    words = [where, f"torch {machine['torch']}" if machine.get("torch") else ""]
    return ", ".join(w for w in words if w) or machine.get("platform") or "not recorded"


def _short_value(value: Any) -> str:
    """A setting for reading: each path by its last two parts (the command has it whole)."""
    if value is True:
        return ""
    pieces = re.split(r"([\s,=])", str(value))
    return "".join("/".join(p.split("/")[-2:]) for p in pieces)


def _settings(row: dict[str, Any]) -> str:
    config = row["config"]
    if row["benchmark"] == "testbed":
        drafters = sorted({name.split("@")[0] for name in row["figures"]})
        config = {k: config[k] for k in TESTBED_KEYS if config.get(k) is not None}
        config["drafters"] = " ".join(drafters)
    shown = [
        f"{k} {_short_value(v)}".strip()
        for k, v in config.items()
        if k not in ("out", "env") and v not in (None, "", False)
    ]
    return "; ".join(shown) or "no config recorded"


def _entry(row: dict[str, Any]) -> list[str]:
    file = row["file"]
    png = RESULTS / Path(file).with_suffix(".png")
    plot = f" ([plot]({Path(file).with_suffix('.png').as_posix()}))" if png.is_file() else ""
    sha = str(row["git_sha"] or "not recorded")
    sha = sha if sha == "unknown" or " " in sha else f"`{sha[:7]}{sha[40:]}`"
    if row["command"]:
        how = f"command ({row['command_from']}): `{row['command']}`"
    else:
        how = f"command: {row['command_from']}"
    return [
        f"- [`{Path(file).name}`]({file}){plot}: **{row['benchmark']}**, "
        f"{str(row['date'] or 'date not recorded')[:10]}, git {sha}, "
        f"{_machine_words(row['machine'])}  ",
        f"  {_settings(row)}  ",
        f"  {how}",
    ]


def render_readme(rows: list[dict[str, Any]]) -> str:
    folders: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        folders.setdefault(row["file"].split("/")[0], []).append(row)
    out = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.results_index` from the results files (do not",
        "edit: a test fails when it is stale); `index.jsonl` holds the same rows with the key",
        "figures. One folder per benchmark. Each file: the benchmark, the date, the git SHA the",
        "run started from (`+dirty`: with uncommitted changes), the machine, its settings (paths",
        "shortened) and its command.",
        "",
        "- Dates: the run's own where the JSON records one, else the day of the file's last",
        "  commit before the results moved into folders.",
        "- Commands: recorded by the run; else reconstructed from the recorded config (one flag",
        "  per setting, the results file where it lies now); else not recorded.",
        "- Paths: `$VLLM_MOA_CACHE` is the cache (default `~/.cache/vllm_moa`), `$TMPDIR` a",
        "  temporary directory of the machine that ran it; others are relative to the checkout.",
        "",
    ]
    out += [
        f"- [{name}/](#{name}): {len(rs)} file{'s' * (len(rs) > 1)}" for name, rs in folders.items()
    ]
    for name, rs in folders.items():
        out += ["", f"## {name}", ""]
        for benchmark in dict.fromkeys(r["benchmark"] for r in rs):
            out.append(f"{benchmark}: {MEASURES.get(benchmark, 'see its script')}.  ")
        out.append("")
        for row in rs:
            out += _entry(row)
    return "\n".join(out) + "\n"


# -- generated tables ------------------------------------------------------------------------


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(find(name).read_text())
    return data


def render_table(name: str, layout: str | None = None) -> str:
    if "," in name:  # several testbed runs, merged
        runs = [_load(n) for n in name.split(",")]
        if any(r.get("benchmark") != "testbed" for r in runs):
            raise SystemExit(f"results-table {name!r}: only testbed runs can be merged")
        return markdown(list(testbed_rows(runs)))
    data = _load(name)
    if layout is not None and layout not in LAYOUTS:
        raise SystemExit(f"results-table marker names layout {layout!r}; known: {list(LAYOUTS)}")
    make = LAYOUTS[layout] if layout is not None else TABLES.get(data.get("benchmark", ""))
    if make is None:
        raise SystemExit(f"no table layout for benchmark {data.get('benchmark')!r} ({name})")
    return markdown(list(make(data)))


def render_doc(text: str) -> str:
    return MARKER.sub(
        lambda m: m.group(1) + render_table(m.group("name"), m.group("layout")) + m.group(5), text
    )


def problems() -> list[str]:
    """Results files that break the folder rules: a stem in two folders, a file outside its
    benchmark's folder, a machine path recorded."""
    out = []
    stems: dict[str, str] = {}
    for path in results_files():
        where = f"{path.parent.name}/{path.name}"
        if path.stem in stems:
            out.append(f"{where}: the name of {stems[path.stem]} too (names must be unique)")
        stems[path.stem] = where
        data = json.loads(path.read_text())
        if path.parent != folder(str(data.get("benchmark"))):
            out.append(f"{where}: a {data.get('benchmark')} result outside its folder")
        out += [f"{where}: machine path {p!r} (name its root)" for p in machine_paths(data)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check", action="store_true", help="fail if the index, README or a table is stale"
    )
    args = p.parse_args(argv)
    rows = index_rows()
    wanted = {INDEX: render_index(rows), README: render_readme(rows)}
    for doc in DOCS:
        if doc.is_file():
            wanted[doc] = render_doc(doc.read_text())
    stale = []
    for path, text in wanted.items():
        if not path.is_file() or path.read_text() != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(text)
    broken = problems()
    for problem in broken:
        print(problem, file=sys.stderr)
    if broken:
        return 1
    if args.check and stale:
        names = ", ".join(map(str, stale))
        print(f"stale: {names}; run `python -m benchmarks.results_index`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
