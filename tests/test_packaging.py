"""The layout the design card names: the Triton kernels in the top-level kernels/ folder, installed
as `vllm_moa.kernels` by pyproject's package-dir mapping (no import-time shim). Checked for an
editable install (this venv), a wheel, and the bare checkout of the GPU machine (nothing installed
there: scripts/device_tree.sh lays the checkout out as an install does)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_import_graph import MAPPED, modules

ROOT = Path(__file__).resolve().parents[1]
# imports vllm_moa.kernels with this venv's editable-install finder removed: a bare checkout
NO_INSTALL = (
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
    "import vllm_moa.kernels.tree_attention as m, benchmarks.gpu_check.run as r\n"
    "print(m.__file__)\n"
    "print(r.__file__)\n"
)


def _packages_on_disk() -> set[str]:
    return {name for name, path in modules().items() if path.name == "__init__.py"}


def test_the_package_list_is_every_package_on_disk():
    """pyproject keeps the package list by hand (setuptools cannot mix a mapped package with
    `packages.find`); a package left out would be missing from the wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _packages_on_disk()
    assert setuptools["package-dir"] == {name: "kernels" for name in MAPPED}
    assert {name: path.relative_to(ROOT).as_posix() for name, path in MAPPED.items()} == {
        "vllm_moa.kernels": "kernels"
    }
    assert not (ROOT / "vllm_moa" / "kernels").exists(), "the kernels live in kernels/ only"


def test_the_editable_install_maps_the_kernels():
    import vllm_moa.kernels.tree_attention as tree_attention

    assert Path(tree_attention.__file__) == ROOT / "kernels" / "tree_attention.py"


@pytest.mark.slow
def test_the_wheel_installs_the_kernels_as_vllm_moa_kernels(tmp_path):
    """Every source file lands at its package path, there is no top-level `kernels` package (PyPI
    has one), and the installed copy imports from itself, from any directory."""
    source = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info/ beside its sources
    source.mkdir()
    skip = shutil.ignore_patterns("__pycache__")
    for name in ("pyproject.toml", "README.md", "LICENSE", "vllm_moa", "kernels"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=skip)
        elif (ROOT / name).is_file():
            shutil.copy(ROOT / name, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    build = subprocess.run(
        [*pip_wheel, "--wheel-dir", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("vllm_moa-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if n.endswith(".py")}
        z.extractall(tmp_path / "site")
    expected = {
        name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
        for name, path in modules().items()
    }
    assert names == expected
    assert "vllm_moa/kernels/tree_attention.py" in names
    assert not any(n.startswith("kernels/") for n in names)
    code = f"import sys\nsys.path.insert(0, {str(tmp_path / 'site')!r})\n" + NO_INSTALL.replace(
        ", benchmarks.gpu_check.run as r", ""
    ).replace("print(r.__file__)\n", "")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()) == tmp_path / "site/vllm_moa/kernels/tree_attention.py"


def _bare(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_INSTALL], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_device_tree_runs_where_nothing_is_installed():
    """scripts/device_tree.sh (used by scripts/gpu_check.sh on the GPU machine) gives a folder
    that imports the kernels and the benchmarks with no install; control: the bare checkout
    itself cannot import the kernels, so the check has something to catch."""
    assert _bare(ROOT).returncode != 0  # the control: no install, no mapping
    made = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_tree.sh")], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    tree = Path(made.stdout.strip().splitlines()[-1])
    try:
        done = _bare(tree)
        assert done.returncode == 0, done.stderr[-2000:]
        kernel, orchestrator = map(Path, done.stdout.split())
        assert kernel == tree / "vllm_moa" / "kernels" / "tree_attention.py"
        assert orchestrator == tree / "benchmarks" / "gpu_check" / "run.py"
    finally:
        subprocess.run(["rm", "-rf", str(tree)], check=True)
