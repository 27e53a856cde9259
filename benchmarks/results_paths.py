"""Where results live and how they name paths: one folder per benchmark under benchmarks/results/,
file stems unique across the folders, and paths recorded relative to a named root, never as this
machine's absolute paths.

    $VLLM_MOA_CACHE/testbed-cpu/target     the cache (`vllm_moa.tiny.default_cache_dir()`)
    benchmarks/results/testbed/x.json      in the checkout: relative to its root
    ../shared/data/HumanEval.jsonl.gz      next to the checkout: relative to its root
    $TMPDIR/random_tp                      a temporary directory
    ~/models/llama                         the home directory

Light on purpose (no torch): `benchmarks.results_index` reads results with it.
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# A benchmark's folder, where it is not the benchmark's own name.
FOLDERS = {
    "standalone_adaptive": "standalone",
    "remote_links": "remote",
    "remote_capacity": "remote",
    "remote_disconnect": "remote",
    "kernels_aot": "kernels",
    "kernels": "kernels",  # benchmarks/kernels_gpu.py
}


def folder(benchmark: str) -> Path:
    """The folder a benchmark's results go to."""
    return RESULTS / FOLDERS.get(benchmark, benchmark)


def results_files() -> list[Path]:
    """Every results JSON, in folder order."""
    return sorted(RESULTS.glob("*/*.json"))


def find(name: str) -> Path:
    """The results file with stem `name`, in whichever folder (a results-table marker's NAME)."""
    hits = [p for p in results_files() if p.stem == name]
    if len(hits) != 1:
        where = ", ".join(str(p.relative_to(RESULTS)) for p in hits) or "no folder"
        raise SystemExit(
            f"results name {name!r} matches {where}: a marker names the stem of exactly one "
            "file under benchmarks/results/<folder>/ (rename one to keep them unique)"
        )
    return hits[0]


# -- paths relative to named roots -----------------------------------------------------------

# A path starts a string or follows one of these (`moa_tli0=/x`, `ngram,/x`, `--out /x`).
_START = r"(?:^|(?<=[\s,=:;'\"]))"
_ABSOLUTE = re.compile(_START + r"/[\w.~-]")


def path_roots() -> list[tuple[str, str]]:
    """(absolute root, its name), the most specific first: the cache before the home directory
    holding it, the checkout before its parent."""
    from vllm_moa.tiny import default_cache_dir  # imports torch: only where results are written

    named = [(default_cache_dir(), "$VLLM_MOA_CACHE"), (ROOT, ".")]
    if ROOT.parent != Path.home():  # a checkout in the home directory: `~/x`, not `../x`
        named.append((ROOT.parent, ".."))
    named += [(Path(t), "$TMPDIR") for t in {tempfile.gettempdir(), "/tmp"}]
    named.append((Path.home(), "~"))
    roots: dict[str, str] = {}
    for path, name in named:
        for spelling in {str(path), os.path.realpath(path)}:
            if spelling != os.sep:  # a home of "/" names nothing
                roots.setdefault(spelling.rstrip(os.sep), name)
    return sorted(roots.items(), key=lambda r: -len(r[0]))


def portable(value: Any, roots: list[tuple[str, str]] | None = None) -> Any:
    """`value` (a JSON document) with every absolute path under a known root rewritten as
    relative to that root's name (module docstring); other values unchanged."""
    roots = path_roots() if roots is None else roots
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        for root, name in roots:
            pattern = _START + re.escape(root) + r"(?P<rest>/|(?=$|[\s,=:;'\"]))"
            value = re.sub(pattern, partial(_named, name), value)
        return value
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list | tuple):  # a tuple is written as a list
        return [portable(v, roots) for v in value]
    return value


def _named(name: str, match: re.Match[str]) -> str:
    if name == ".":  # the checkout: `benchmarks/results/x.json`, not `./benchmarks/...`
        return "" if match["rest"] else "."
    return name + match["rest"]


def machine_paths(data: dict[str, Any]) -> list[str]:
    """The absolute paths a results file records: any in its `config`, and elsewhere any value
    that is a path (prose and log tails, which have spaces, may quote one)."""

    def walk(value: Any, in_config: bool) -> Iterator[str]:
        if isinstance(value, str):
            if (in_config or not any(c.isspace() for c in value)) and _ABSOLUTE.search(value):
                yield value
        elif isinstance(value, dict):
            for key, v in value.items():
                yield from walk(v, in_config or key == "config")
        elif isinstance(value, list):
            for v in value:
                yield from walk(v, in_config)

    return list(walk(data, False))


_SHELL_SAFE = re.compile(r"^[\w@%+=:,./~$-]+$")  # `$VLLM_MOA_CACHE/x` stays unquoted: it expands


def shell_join(words: list[str]) -> str:
    return " ".join(w if _SHELL_SAFE.match(w) else shlex.quote(w) for w in words)
