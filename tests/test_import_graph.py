"""The package's modules import one another without a cycle, counting every import: module level,
inside functions (late imports of optional dependencies) and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_moa"
# pyproject's package-dir mapping (tests/test_packaging.py checks they agree): the top-level
# kernels/ folder installs as vllm_moa.kernels
MAPPED = {"vllm_moa.kernels": ROOT / "kernels"}


def _module_name(path: Path, folder: Path, name: str) -> str:
    parts = (*name.split("."), *path.relative_to(folder).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE, mapped: dict[str, Path] | None = None) -> dict[str, Path]:
    """Module name -> source file, for the package and the folders mapped into it."""
    mapped = MAPPED if mapped is None and package == PACKAGE else mapped or {}
    folders = {package.name: package, **mapped}
    return {_module_name(p, d, n): p for n, d in folders.items() for p in sorted(d.rglob("*.py"))}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source."""
    paths = modules(package)
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], base]).rstrip(".")
                # `from pkg import sub` imports pkg.sub; `from mod import name` imports mod
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in paths]
                targets = targets or [base]
            else:
                continue
            graph[name] |= {t for t in targets if t in paths and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same arrows between the package's sub-packages (vllm_moa.decoding, ...)."""

    def floor(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {floor(m): set() for m in graph}
    for module, targets in graph.items():
        out[floor(module)] |= {floor(t) for t in targets} - {floor(module)}
    return out


def test_no_cycles_between_sub_packages():
    """Every arrow between floors points down: e.g. decoding and training import no drafter
    kind (the factories one floor above the kinds build what they run)."""
    assert cycles(package_graph(import_graph())) == []


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_late_and_type_checking_imports_count(tmp_path):
    """Control: a cycle closed by an import inside a function, or under TYPE_CHECKING, is
    found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import x\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]
