"""Check a vLLM release's source for every internal the plugin relies on (`symbols.SYMBOLS`).

The source is read, never imported, so any release can be checked on any machine: a directory
that holds the `vllm/` package (an installed site-packages) or a wheel file (`pip download
vllm==X --no-deps`). A symbol passes when its file exists and defines it as its kind says; for a
function or method whose signature we depend on, our parameters must appear in the release's in
the same order, and any parameter the release adds must have a default.

    python -m vllm_moa.vllm_plugin.compat.source_check vllm-0.33.0-....whl  # or site-packages
"""

from __future__ import annotations

import argparse
import ast
import zipfile
from collections.abc import Iterator
from pathlib import Path

from vllm_moa.vllm_plugin.compat.symbols import SYMBOLS, Symbol


class Source:
    """The .py files of a vLLM release: a directory containing `vllm/`, or a wheel."""

    def __init__(self, where: str | Path) -> None:
        self.where = Path(where)
        self._zip = zipfile.ZipFile(self.where) if self.where.is_file() else None
        self._trees: dict[str, ast.Module | None] = {}

    def read(self, path: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(path).decode()
            except KeyError:
                return None
        file = self.where / path
        return file.read_text() if file.is_file() else None

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            text = self.read(path)
            self._trees[path] = None if text is None else ast.parse(text, filename=path)
        return self._trees[path]

    def version(self) -> str:
        """The release's version, from the wheel's name or vllm/_version.py."""
        if self._zip is not None:
            return self.where.name.split("-")[1]
        tree = self.tree("vllm/_version.py")
        for node in tree.body if tree is not None else []:
            names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            value = getattr(node, "value", None)
            if {"__version__", "version"} & set(names) and isinstance(value, ast.Constant):
                return str(value.value)
        return "unknown"


def _classes(body: list[ast.stmt]) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in body if isinstance(n, ast.ClassDef)}


def _find_class(tree: ast.Module, dotted: str) -> ast.ClassDef | None:
    body: list[ast.stmt] = tree.body
    found = None
    for part in dotted.split("."):
        found = _classes(body).get(part)
        if found is None:
            return None
        body = found.body
    return found


def _lineage(tree: ast.Module, cls: ast.ClassDef) -> Iterator[ast.ClassDef]:
    """The class, then its bases defined in the same file (depth first)."""
    seen: set[str] = set()
    todo = [cls]
    while todo:
        c = todo.pop(0)
        if c.name in seen:
            continue
        seen.add(c.name)
        yield c
        for base in c.bases:
            name = base.id if isinstance(base, ast.Name) else None
            parent = _find_class(tree, name) if name else None
            if parent is not None:
                todo.append(parent)


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


def _module_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, including those under `if` / `try` (TYPE_CHECKING, fallbacks)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                todo += handler.body


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, bool]]:
    """(name, has a default) of each parameter, `*args` / `**kwargs` marked as in the def."""
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = [(p.arg, i >= first_default) for i, p in enumerate(positional)]
    if a.vararg is not None:
        out.append((f"*{a.vararg.arg}", True))
    out += [(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg is not None:
        out.append((f"**{a.kwarg.arg}", True))
    return out


def _check_params(fn: ast.FunctionDef | ast.AsyncFunctionDef, ours: tuple[str, ...]) -> str:
    theirs = _params(fn)
    names = [n for n, _ in theirs]
    missing = [p for p in ours if p not in names]
    if missing:
        return f"parameters {missing} are gone (now {names})"
    order = [names.index(p) for p in ours]
    if order != sorted(order):
        return f"parameters reordered: ours {list(ours)}, now {names}"
    added = [n for n, has_default in theirs if n not in ours and not has_default]
    if added:
        return f"new required parameters {added} (now {names})"
    return ""


def check_symbol(source: Source, sym: Symbol) -> str:
    """'' when the release has `sym` as we use it, else what is wrong."""
    tree = source.tree(sym.path)
    if tree is None:
        return "file missing"
    if sym.kind == "module":
        return ""
    owner, _, name = sym.qualname.rpartition(".")
    if sym.kind in ("function", "module-attribute", "re-export") or (
        sym.kind == "class" and not owner
    ):
        for node in _module_level(tree):
            if name in _defined_names(node):
                if sym.params is not None and isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef)
                ):
                    return _check_params(node, sym.params)
                return ""
        return "not defined at module level"
    if sym.kind == "class":
        return "" if _find_class(tree, sym.qualname) is not None else "class missing"
    if sym.kind == "instance-attribute":
        # Assigned on an instance anywhere in the file (self.x = ..., layer.x = ...).
        for walked in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(walked, ast.Assign):
                targets = walked.targets
            elif isinstance(walked, (ast.AnnAssign, ast.AugAssign)):
                targets = [walked.target]
            for t in targets:
                elements = t.elts if isinstance(t, ast.Tuple) else [t]
                if any(isinstance(e, ast.Attribute) and e.attr == name for e in elements):
                    return ""
        return "never assigned"
    cls = _find_class(tree, owner)
    if cls is None:
        return f"class {owner} missing"
    for c in _lineage(tree, cls):
        for node in c.body:
            if name not in _defined_names(node):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if sym.kind in ("dataclass-field", "enum-member"):
                    return f"now a method, not a {sym.kind}"
                decorators = {
                    d.id if isinstance(d, ast.Name) else getattr(d, "attr", "")
                    for d in node.decorator_list
                }
                wanted = sym.kind in ("property", "staticmethod", "classmethod")
                if wanted and sym.kind not in decorators and "cached_property" not in decorators:
                    return f"no longer a {sym.kind}"
                return _check_params(node, sym.params) if sym.params is not None else ""
            return ""
    return f"not defined in {owner} or its bases in this file"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())


def wanted(version: str) -> list[Symbol]:
    """The symbols release `version` must have: not those from a later release (`since`), nor
    those only an earlier release's path uses (`until`)."""
    release = _release(version)
    return [
        s
        for s in SYMBOLS
        if not (s.since and release < _release(s.since))
        and not (s.until and release > _release(s.until))
    ]


def check(source: Source) -> list[tuple[Symbol, str]]:
    """Every symbol the release lacks or changed, with what is wrong (see `wanted`)."""
    problems = []
    for sym in wanted(source.version()):
        problem = check_symbol(source, sym)
        if problem:
            problems.append((sym, problem))
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a vLLM wheel, or a directory containing the vllm/ package")
    args = p.parse_args(argv)
    source = Source(args.source)
    problems = check(source)
    for sym, problem in problems:
        print(f"{sym.path}: {sym.qualname} ({sym.kind}, used by {sym.used_by}): {problem}")
    n = len(wanted(source.version()))
    print(f"vLLM {source.version()}: {n - len(problems)} of {n} symbols ok")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
