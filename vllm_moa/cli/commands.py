"""What each `vllm-moa` subcommand does (argument parsing lives in main.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_moa.cli.common import encode_prompt, runtime
from vllm_moa.hf_target.eos import eos_ids, eos_ids_of

if TYPE_CHECKING:
    from vllm_moa.demo import DemoRecipe

NGRAM = "ngram"  # `--drafter ngram`: prompt-lookup drafting, no model (factories.proposers')


def init_drafter(args: argparse.Namespace) -> int:
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.hf_target import load_target_info
    from vllm_moa.model.layers import count_parameters

    info = load_target_info(args.target)
    config = make_config(info, preset=args.preset, tli=args.tli)
    drafter = MoADrafter(config)
    drafter.init_weights(args.seed)
    out = save_drafter(drafter, args.out)
    params = count_parameters(drafter)["total"]
    print(f"wrote {args.preset} MoA drafter (TLI={args.tli}, {params:,} parameters) to {out}")
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return str(args.prompt)
    path = Path(args.prompt_file)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    return path.read_text()


def run_generation(
    target_dir: str,
    drafter_dir: str | None,
    prompt: str,
    *,
    chat: bool = False,
    max_new_tokens: int,
    sampling: Any = None,
    num_speculative_tokens: int = 4,
    seed: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    tree: Any = None,
    adaptive: bool = True,
    hierarchy: list[str] | None = None,
    buffers: list[int] | None = None,
) -> dict[str, Any]:
    """Load target (+ drafter, or the levels of a hierarchy), generate, and return the CLI's
    JSON record."""
    from transformers import AutoTokenizer

    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.decoding import SamplingParams, SpeculativeEngine
    from vllm_moa.factories.proposers import make_proposer
    from vllm_moa.hf_target import HFTarget

    sampling = sampling or SamplingParams()
    target = HFTarget.from_pretrained(target_dir, dtype=dtype, device=device)
    if hierarchy is not None:
        from vllm_moa.cli.hsd import run_hierarchy

        return run_hierarchy(
            target, target_dir, hierarchy, buffers, prompt, chat, max_new_tokens, sampling, seed
        )
    proposer: Any = None
    if drafter_dir == NGRAM:
        from vllm_moa.decoding.ngram_proposer import NgramProposer

        proposer = NgramProposer(target.shape.vocab_size)
    elif drafter_dir is not None:
        drafter = load_drafter(drafter_dir, target=target.shape, dtype=dtype, device=device)
        proposer = make_proposer(drafter, target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = encode_prompt(tokenizer, prompt, chat, target_dir)
    engine = SpeculativeEngine(target, proposer)
    result = engine.generate(
        list(ids),
        max_new_tokens,
        sampling,
        num_speculative_tokens=num_speculative_tokens,
        eos_token_ids=eos_ids(tokenizer, target.model),
        seed=seed,
        tree=tree,
        adaptive=adaptive,
    )
    record: dict[str, Any] = {
        "text": tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "token_ids": result.token_ids,
        "prompt_tokens": len(ids),
        "finish_reason": result.finish_reason,
        "speculative": proposer is not None,
    }
    record.update(result.stats.to_dict())
    return record


def _print_stats(record: dict[str, Any], file: Any = sys.stdout) -> None:
    hist = record["accepted_length_histogram"]
    rates = ", ".join(f"{r:.2f}" for r in record["acceptance_rate_per_position"])
    print(
        f"[{record['num_generated_tokens']} tokens, {record['target_calls']} target calls, "
        f"tau={record['mean_accepted_length']:.2f}, histogram={hist}, "
        f"drafts per cycle={record['draft_length_histogram']}, "
        f"per-position acceptance=[{rates}], {record['tokens_per_second']:.1f} tok/s, "
        f"finish={record['finish_reason']}]",
        file=file,
    )
    for level in record.get("levels", []):
        print(
            f"  [level {level['name']} (T={level['buffer']}): {level['forward_passes']} passes, "
            f"{level['accepted']}/{level['proposed']} tokens accepted above, "
            f"alpha={level['alpha']:.2f}]",
            file=file,
        )


def _tree_params(args: argparse.Namespace) -> Any:
    """TreeParams from --tree-depth/--tree-breadth/--tree-tokens, or None for chains."""
    if all(x is None for x in (args.tree_depth, args.tree_breadth, args.tree_tokens)):
        return None
    from vllm_moa.decoding.tree import TreeParams

    if args.drafter is None:
        raise ValueError("--tree-* options need --drafter (a MoA, EAGLE or independent drafter)")
    defaults = TreeParams()
    return TreeParams(
        depth=args.tree_depth or defaults.depth,
        breadth=args.tree_breadth or defaults.breadth,
        budget=args.tree_tokens or defaults.budget,
    )


def generate(args: argparse.Namespace) -> int:
    from vllm_moa.cli.hsd import hierarchy_args
    from vllm_moa.decoding import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    device, dtype = runtime(args)
    hierarchy, buffers = hierarchy_args(args)
    tree = _tree_params(args)
    record = run_generation(
        args.target,
        args.drafter,
        _read_prompt(args),
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        num_speculative_tokens=args.num_speculative_tokens,
        seed=args.seed,
        device=device,
        dtype=dtype,
        tree=tree,
        adaptive=args.adaptive,
        hierarchy=hierarchy,
        buffers=buffers,
    )
    if args.json:
        print(json.dumps(record))
    else:
        print(record["text"])
        _print_stats(record, file=sys.stderr)
    return 0


def remote_server(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from transformers import AutoTokenizer

    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.checkpoint.io import drafter_dir_of
    from vllm_moa.hf_target import HFTarget
    from vllm_moa.remote.server import RemoteServer, ServerLimits
    from vllm_moa.remote.split import ServerHalf, fingerprint
    from vllm_moa.remote.verifier import Verifier

    device, dtype = runtime(args)
    drafter_dir = drafter_dir_of(args.drafter)
    target = HFTarget.from_pretrained(args.target, dtype=dtype, device=device)
    drafter = load_drafter(drafter_dir, target=target.shape, dtype=dtype, device=device)
    eos = eos_ids_of(args.target, AutoTokenizer.from_pretrained(args.target))
    half = ServerHalf(drafter, target.shape.num_layers)
    verifier = Verifier(target, half, fingerprint(drafter_dir), eos)
    limits = ServerLimits(max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(
        f"serving {args.target} with the server half of a {half.kind} drafter ({drafter_dir}) "
        f"on {args.host}:{args.port}",
        flush=True,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(RemoteServer(verifier, limits).serve_forever(args.host, args.port))
    return 0


def remote_generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_moa.decoding import SamplingParams
    from vllm_moa.remote.client import RemoteClient

    device, dtype = runtime(args)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    tree = _tree_params(args)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ids = encode_prompt(tokenizer, _read_prompt(args), args.chat, args.target)
    private: list[int] = []
    if args.private_suffix:
        if args.chat:
            raise ValueError("--private-suffix cannot be combined with --chat")
        private = list(tokenizer(args.private_suffix, add_special_tokens=False)["input_ids"])
    client = RemoteClient(args.server, args.target, args.drafter, dtype=dtype, device=device)
    result = client.generate(
        ids,
        args.max_new_tokens,
        sampling,
        num_speculative_tokens=args.num_speculative_tokens,
        tree=tree,
        seed=args.seed,
        eos_token_ids=eos_ids_of(args.target, tokenizer),
        disconnect_after=args.disconnect_after,
        reconnect_every=args.reconnect_every,
        private_suffix=private,
        adaptive=args.adaptive,
    )
    record = {
        "text": tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "prompt_tokens": len(ids),
        "drafter": client.kind,
        "tli": client.tli,
        **result.to_dict(),
    }
    if args.json:
        print(json.dumps(record))
    else:
        print(record["text"])
        gone = result.disconnected_at
        print(
            f"[{len(result.token_ids)} tokens, {result.server_calls} server calls, "
            f"tau={result.mean_accepted_length:.2f}, up {result.bytes_up} B, "
            f"down {result.bytes_down} B, {result.tokens_per_second:.1f} tok/s, "
            f"finish={result.finish_reason}"
            + (f", finished on the device after {gone} tokens]" if gone is not None else "]"),
            file=sys.stderr,
        )
    return 0


def convert(args: argparse.Namespace) -> int:
    from vllm_moa.checkpoint import ConvertOptions, convert_official
    from vllm_moa.hf_target import load_target_info

    target = load_target_info(args.target) if args.target else None
    out = convert_official(args.src, args.dst, ConvertOptions(tli=args.tli, target=target))
    print(f"converted {args.src} -> {out}")
    return 0


def export_eagle(args: argparse.Namespace) -> int:
    from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle, vllm_method_of

    out = export_vllm_eagle(args.drafter, args.target, args.out)
    method = vllm_method_of(args.drafter)
    spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": 4})
    print(f"vLLM {method} checkpoint written to {out}")
    print(f"serve it with: vllm serve {args.target} --speculative-config '{spec}'")
    return 0


def inflate(args: argparse.Namespace) -> int:
    from vllm_moa.checkpoint.inflate import inflate_drafter, inflate_target
    from vllm_moa.checkpoint.io import drafter_dir_of

    out = Path(args.out)
    widening = inflate_target(
        args.target, out / "target", args.hidden_size, args.intermediate_size, args.num_heads
    )
    print(f"target widened to E={args.hidden_size}, MLP {args.intermediate_size}, "
          f"{args.num_heads} heads: {out / 'target'}")  # fmt: skip
    names: set[str] = set()
    for path in args.drafter:
        source = drafter_dir_of(path)
        name = source.parent.name if source.name == "drafter" else source.name
        while name in names:
            name += "_"
        names.add(name)
        written = inflate_drafter(source, out / "drafters" / name, widening)
        print(f"drafter {source} widened: {written}")
    return 0


def train(args: argparse.Namespace) -> int:
    import dataclasses

    from vllm_moa.devices import resolve_device
    from vllm_moa.factories.methods import make_trainer
    from vllm_moa.training import TrainConfig

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    values.update(data=tuple(args.data), device=resolve_device(args.device))
    cfg = TrainConfig(**values)
    out = make_trainer(cfg).train()
    print(f"trained drafter written to {out}")
    return 0


def demo(args: argparse.Namespace) -> int:
    return run_demo(
        args.cache_dir, args.prompt, args.max_new_tokens, args.num_speculative_tokens, args.rounds
    )


def run_demo(
    cache_dir: str | None,
    prompts: list[str] | None,
    max_new_tokens: int,
    num_speculative_tokens: int,
    rounds: int,
    recipe: DemoRecipe | None = None,
) -> int:
    """Plain decoding and MoA side by side on the demo's widened pair; 1 if any output differs."""
    from vllm_moa.demo import PROMPTS, compare, ensure_demo_models

    target_dir, drafter_dir = ensure_demo_models(cache_dir, recipe)
    prompts = prompts or list(PROMPTS)
    print(f"target:  {target_dir}\ndrafter: {drafter_dir}")
    print(f"{len(prompts)} prompts x {max_new_tokens} greedy tokens, {rounds} rounds of each ...\n")
    result = compare(
        target_dir, drafter_dir, prompts, max_new_tokens, num_speculative_tokens, rounds
    )
    for prompt, text in zip(prompts, result.moa.texts, strict=True):
        print(f"--- {prompt!r} ---\n{prompt}{text}\n")
    plain, moa = result.plain, result.moa
    print(f"{'':32}{'plain':>10}{'MoA':>10}")
    print(f"{'tokens/s (median of rounds)':32}{plain.median_tokens_per_s:>10.1f}"
          f"{moa.median_tokens_per_s:>10.1f}")  # fmt: skip
    print(f"{'tokens per target pass':32}{plain.tokens_per_target_pass:>10.2f}"
          f"{moa.tokens_per_target_pass:>10.2f}")  # fmt: skip
    same = result.identical == len(prompts)
    print(f"\noutputs identical to plain greedy decoding: {result.identical}/{len(prompts)}")
    print(f"speed-up: {result.speedup:.2f}x (MoA over plain, median of the rounds' ratios)")
    return 0 if same else 1
