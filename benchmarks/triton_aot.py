"""Compile the kernels for a CUDA GPU on a machine without one, and read what the build needs.

The wrappers' launches are captured instead of run (`capture`), then each is built the way
Triton's JIT would build it on the GPU (the JIT's own argument specialisation: dtypes, 16-byte
alignment, integers equal to 1 or divisible by 16) for a chosen architecture, down to the cubin,
by Triton's compiler and the ptxas it ships (`build`). From the cubin: registers per thread,
local memory (register spills), the dynamic shared memory the launch asks for (checked against
the architecture's per-block limit, as the launch would be), and from its SASS the tensor-core
instructions and the widths of the global loads. No GPU, driver or CUDA toolkit needed; it is
what `benchmarks/kernels_aot.py` and `tests/test_kernels_aot.py` run, so kernels that would not
compile or would not fit on a GPU are caught where none is. Timing still needs the GPU
(`benchmarks/kernels_gpu.py`).

Needs the JIT to compile, not interpret: run it in a process without TRITON_INTERPRET=1.
Uses two Triton internals (the JIT's argument binder and `_pack_args`), checked on Triton 3.6
and 3.9.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

# Largest dynamic shared memory one block may use (bytes), by compute capability: a launch that
# asks for more fails with OutOfResources. A100 163 KB, Hopper (H100/H200) 227 KB, Ada/Ampere
# consumer parts 99 KB (CUDA programming guide, "Technical Specifications per Compute Capability").
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
MAX_REGISTERS = 255  # per thread, every architecture here
# SASS tensor-core instructions: Hopper's warpgroup MMA (wgmma) and the warp-level mma.sync
TENSOR_CORE_OPS = ("HGMMA", "HMMA")


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a wrapper made it: the @triton.jit function, grid and arguments."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Build:
    """What one launch's cubin needs on the GPU of compute capability `arch`."""

    kernel: str
    arch: int
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    shared_bytes: int  # dynamic shared memory per block
    registers: int  # per thread
    local_bytes: int  # per thread: register spills and stack (0 = none)
    tensor_core_ops: dict[str, int] = field(default_factory=dict)  # SASS instruction counts
    global_loads: dict[str, int] = field(default_factory=dict)  # SASS LDG* by width, e.g. LDG.E.128

    @property
    def fits(self) -> bool:
        """Launchable: shared memory within the architecture's per-block limit (ptxas keeps
        registers within MAX_REGISTERS itself, spilling the rest: see local_bytes)."""
        return self.shared_bytes <= SHARED_LIMIT[self.arch]

    def as_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "arch": f"sm_{self.arch}",
            "constexprs": self.constexprs,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "shared_bytes": self.shared_bytes,
            "shared_limit": SHARED_LIMIT[self.arch],
            "registers": self.registers,
            "local_bytes": self.local_bytes,
            "tensor_core_ops": self.tensor_core_ops,
            "global_loads": self.global_loads,
            "fits": self.fits,
        }


@contextmanager
def capture(module: ModuleType, name: str) -> Iterator[list[Launch]]:
    """While the block runs, `module.<name>[grid](...)` records a Launch instead of running."""
    real = getattr(module, name)
    launches: list[Launch] = []

    class _Recorder:
        def __getitem__(self, grid: tuple[int, ...]):
            def record(*args: Any, **kwargs: Any) -> None:
                launches.append(Launch(real, tuple(grid), args, kwargs))

            return record

    setattr(module, name, _Recorder())
    try:
        yield launches
    finally:
        setattr(module, name, real)


def build(launch: Launch, arch: int = 90) -> Build:
    """Compile `launch` for compute capability `arch` as the JIT would, down to the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    try:
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as e:
        raise RuntimeError(
            f"benchmarks.triton_aot uses Triton's JIT internals of Triton 3.6-3.9; this is Triton "
            f"{triton.__version__} ({e})"
        ) from e
    if arch not in SHARED_LIMIT:
        raise ValueError(f"arch {arch}: use one of {sorted(SHARED_LIMIT)}")
    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(
            f"{type(kernel).__name__} is not a compiled Triton kernel: unset TRITON_INTERPRET "
            "before the kernels are imported (run in a separate process)"
        )
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
    )
    usage, sass = _inspect(compiled.asm["cubin"])
    ops = Counter(re.findall(r"\b(" + "|".join(TENSOR_CORE_OPS) + r")\b", sass))
    loads = Counter(re.findall(r"\b(LDG(?:STS)?(?:\.[A-Z0-9_]+)*)", sass))
    names = kernel.arg_names
    return Build(
        kernel=kernel.__name__,
        arch=arch,
        constexprs={names[path[0]]: value for path, value in constexprs.items()},
        num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages,
        shared_bytes=compiled.metadata.shared,
        registers=usage["REG"],
        local_bytes=usage["LOCAL"] + usage["STACK"],
        tensor_core_ops=dict(sorted(ops.items())),
        global_loads=dict(sorted(loads.items())),
    )


def _inspect(cubin: bytes) -> tuple[dict[str, int], str]:
    """cuobjdump (shipped with Triton): the resource-usage line and the SASS of a cubin."""
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = _run([tool, "--dump-resource-usage", str(path)])
        sass = _run([tool, "-sass", str(path)])
    line = re.search(r"REG:\d+.*", usage)
    if line is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{usage}")
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line.group(0))}, sass


def _run(command: list[str]) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout
