"""`vllm-moa real-target`: a real released model (SmolLM2-135M-Instruct) as a target checkpoint
(argument parsing lives in main.py)."""

from __future__ import annotations

import argparse


def real_target(args: argparse.Namespace) -> int:
    """Fetch and import the named real target (cached), or import `--gguf FILE` into `--out DIR`;
    print the checkpoint's directory last on stdout (T=$(vllm-moa real-target | tail -1))."""
    from vllm_moa.checkpoint.gguf_import import import_gguf
    from vllm_moa.checkpoint.real_target import real_target as fetch_real_target

    if (args.gguf is None) != (args.out is None):
        raise ValueError(
            "--gguf FILE and --out DIR go together (import that file into DIR); without them "
            "the named real target is fetched into --cache-dir"
        )
    try:
        if args.gguf is None:
            path = fetch_real_target(args.name, args.dtype, args.cache_dir)
        else:
            path = import_gguf(args.gguf, args.out, args.dtype)
    except ImportError as e:  # a missing optional dependency: one line, as main prints errors
        raise ValueError(str(e)) from None
    print(path)
    return 0
