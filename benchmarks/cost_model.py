"""GPU cost model at Llama-3-8B shapes (random bf16 weights): what one speculative cycle costs,
and the speedup a drafter's measured tau buys at that cost. One run, one JSON + PNG.

    python -m benchmarks.cost_model --out benchmarks/results/cost_model/cost_model_h200.json \
        --tau benchmarks/results/testbed/testbed_cpu_tree.json

Timing does not depend on trained weights, so the target (32 layers, E=4096, 32 heads / 8 KV
heads of 128, MLP 14336, vocab 128256) and the drafters (the `paper` presets: MoA TLI 0/1/3,
MoA without LSA, EAGLE, a 2-layer independent LM) are random. Everything runs through the
standalone engine's own code (HFTarget, the proposers, tree verification with the Triton tree
kernel on CUDA), eager PyTorch at batch 1, with a `--context`-token prefix (default 1024).
Timed (median, triton.testing.do_bench on CUDA; wall clock in --smoke):
- plain decode step (1 token), verify pass of K+1 chain tokens (K = 4, 6) and of an EAGLE-2
  tree (root + 62 nodes, depth <= 6, drafted by the MoA proposer);
- each drafter's proposal: a chain of K (K = 1, 4, 6) and a tree (depth 6, breadth 8, 62 nodes);
- LSA per cycle (MoA): the memory rows of n = 1..7 newly verified tokens.
Projection per drafter and mode, with tau from a testbed results JSON (--tau; its method
names): cycle = propose + verify (+ memory rows of round(tau) tokens), speedup =
tau * decode / cycle, and the break-even tau = cycle / decode. The same from a memory-bound
lower bound (bytes each step must read / the measured device-to-device copy bandwidth),
because eager batch-1 PyTorch adds launch overheads vLLM's CUDA graphs remove.
The taus of the cpu testbed come from a 4-layer target and 1M-parameter drafters: the
projection says what they would buy at 8B cost, not what an 8B drafter achieves.
`--smoke` runs tiny shapes on the CPU to check the script itself; `--reproject MEASURED.json
--tau OTHER.json --out NEW.json` re-projects a saved measurement with other taus, on any machine
(testbed methods `<name>_slim` are projected at `<name>`'s cost).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.kernels_gpu import import_kernels

KS = (1, 4, 6)
TREE = (6, 8, 62)  # depth, breadth, nodes (the paper's)
MAX_ROWS = 7  # memory rows per cycle at most: K + 1 for K = 6


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float


LLAMA3_8B = Shape(128256, 4096, 14336, 32, 32, 8, 128, 500000.0)
SMOKE = Shape(512, 128, 256, 4, 2, 1, 64, 10000.0)


def build_target(shape: Shape, device: str, dtype: torch.dtype) -> Any:
    import transformers as tf

    from vllm_moa.hf_target import HFTarget

    config: Any = tf.LlamaConfig(  # type: ignore[call-arg]
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype on the device: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model: Any = tf.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return HFTarget(model.to(dtype).eval())


def build_drafters(target: Any, device: str, dtype: torch.dtype) -> dict[str, nn.Module]:
    from vllm_moa.drafters.eagle.model import EagleDrafter
    from vllm_moa.drafters.independent.model import IndependentDrafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import (
        TargetInfo,
        make_config,
        make_eagle_config,
        make_independent_config,
    )

    info = TargetInfo(target.shape, target.config.num_attention_heads)
    drafters: dict[str, nn.Module] = {
        **{f"moa_tli{t}": MoADrafter(make_config(info, "paper", tli=t)) for t in (0, 1, 3)},
        "moa_no_lsa": MoADrafter(make_config(info, "paper", memory_source="hidden")),
        "eagle": EagleDrafter(make_eagle_config(info, "paper")),
        "independent": IndependentDrafter(make_independent_config(info, "paper")),
    }
    for d in drafters.values():
        d.init_weights(0)  # type: ignore[operator]
        d.to(device=device, dtype=dtype).eval()
    return drafters


def make_timer(device: str) -> Callable[[Callable[[], object]], float]:
    """fn -> median milliseconds (do_bench on CUDA; a few wall-clock runs on the CPU)."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=25, rep=200, return_mode="median"))

    def wall(fn: Callable[[], object]) -> float:
        fn()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(runs)

    return wall


def param_bytes(*modules: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def _reset(proposer: Any, length: int) -> None:
    """Back to the state of a new cycle with nothing accepted: the last token (at `length`) is
    the one pending drafter input (EAGLE's is at length - 1: its input pairs a feature with the
    next token)."""
    from vllm_moa.drafters.eagle.proposer import EagleProposer

    keep = length - 1 if isinstance(proposer, EagleProposer) else length
    for name in ("sa_cache", "cache"):
        cache = getattr(proposer, name, None)
        if cache is not None and cache.length() > keep:
            cache.crop(keep)


def measure(shape: Shape, device: str, dtype: torch.dtype, context: int) -> dict[str, Any]:
    from vllm_moa.decoding.sampling import SamplingParams
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.factories.proposers import make_proposer

    timer = make_timer(device)
    target = build_target(shape, device, dtype)
    drafters = build_drafters(target, device, dtype)
    p, num_layers = context, target.shape.num_layers
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape.vocab_size, (p,), generator=gen).tolist()
    last = int(torch.randint(0, shape.vocab_size, (1,), generator=gen))
    target.reset()
    prefill = target.forward(torch.tensor(prompt), hidden_layers=(num_layers,))
    greedy = SamplingParams()

    def target_pass(ids: torch.Tensor) -> Callable[[], object]:
        return lambda: (target.forward(ids), target.crop(p))

    ms: dict[str, Any] = {"decode": timer(target_pass(torch.tensor([last])))}
    for k in KS[1:]:
        ms[f"verify_k{k}"] = timer(target_pass(torch.randint(0, shape.vocab_size, (k + 1,))))

    proposers = {name: make_proposer(d, target) for name, d in drafters.items()}
    drafts: dict[str, Any] = {}
    tree = None
    for name, proposer in proposers.items():
        proposer.start(prompt, prefill)
        proposer.propose(last, 1, greedy, None)  # the prompt's drafter pass, once
        _reset(proposer, p)
        row: dict[str, float] = {}
        for k in KS:

            def chain(proposer: Any = proposer, k: int = k) -> None:
                proposer.propose(last, k, greedy, None)
                _reset(proposer, p)

            row[f"chain_k{k}"] = timer(chain)

        def draft_tree(proposer: Any = proposer) -> Any:
            out = proposer.propose_tree(last, *TREE)
            _reset(proposer, p)
            return out

        row["tree"] = timer(draft_tree)
        if name == "moa_tli0":
            tree = draft_tree()
        drafter = drafters[name]
        if isinstance(drafter, MoADrafter):  # memory rows per verified token
            width = (
                (num_layers, 2 * target.shape.kv_width)
                if drafter.uses_lsa
                else (target.shape.hidden_size,)
            )
            for n in range(1, MAX_ROWS + 1):
                features = torch.randn(n, *width, device=device, dtype=dtype)
                positions = torch.arange(p, p + n, device=device)

                def rows(d: Any = drafter, f: torch.Tensor = features, x: Any = positions) -> Any:
                    with torch.no_grad():
                        return d.memory_kv(d.encode_memory(f)[None], x)

                row[f"memory_rows_{n}"] = timer(rows)
        drafts[name] = row
    assert tree is not None
    ids, positions, allowed = tree.verification_inputs(last, p)

    def verify_tree() -> None:
        target.forward_tree(ids, positions, allowed)
        target.crop(p)

    ms["verify_tree"] = timer(verify_tree)
    ms["drafters"] = drafts

    copy_src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = timer(lambda: copy_dst.copy_(copy_src))
    bandwidth = 2 * copy_src.numel() / (copy_ms * 1e-3)  # bytes read + written per second
    return {
        "ms": ms,
        "verified_tree": {"nodes": tree.size, "depth": max(tree.depths())},
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "bytes": memory_bytes(target, drafters, p),
        "parameters": {n: sum(x.numel() for x in d.parameters()) for n, d in drafters.items()},
    }


def memory_bytes(target: Any, drafters: dict[str, nn.Module], context: int) -> dict[str, Any]:
    """Bytes each step must read at least (weights + the K/V it attends over), for the
    memory-bound lower bound. Shared modules (the LM head, TLI's target layers) count in full:
    every draft step reads them."""
    from vllm_moa.drafters.moa.model import MoADrafter

    s = target.shape
    elem = next(target.model.parameters()).element_size()
    head = param_bytes(target.lm_head)

    def kv(layers: int, kv_heads: int, head_dim: int) -> int:  # K and V of the cached prefix
        return context * layers * 2 * kv_heads * head_dim * elem

    out: dict[str, Any] = {
        "target_step": param_bytes(target.model) + kv(s.num_layers, s.num_kv_heads, s.head_dim),
        "drafters": {},
    }
    for name, d in drafters.items():
        cfg: Any = getattr(d, "config", None)
        if isinstance(d, MoADrafter):
            tail = list(target.layers)[s.num_layers - cfg.tli :] if cfg.tli else []
            head_dim = s.hidden_size // cfg.ca_num_heads
            kv_heads = cfg.ca_num_kv_heads + cfg.sa_num_kv_heads
            lsa = cfg.memory_source == "lsa"
            out["drafters"][name] = {
                "draft_step": param_bytes(d.self_attention, d.cross_attention, *tail)
                + head
                + kv(1, kv_heads, head_dim)
                + kv(cfg.tli, s.num_kv_heads, s.head_dim),
                "memory_fixed": param_bytes(
                    *(
                        m
                        for n, m in d.named_children()
                        if n not in ("self_attention", "cross_attention")
                    )
                ),
                "memory_per_row": s.num_layers * 2 * s.kv_width * elem if lsa else 0,
            }
        else:  # EAGLE (one layer) or the independent LM (num_layers)
            layers = getattr(cfg, "num_layers", 1)
            cached = kv(layers, cfg.num_kv_heads, s.hidden_size // cfg.num_heads)
            out["drafters"][name] = {"draft_step": param_bytes(d) + head + cached}
    return out


def project(result: dict[str, Any], taus: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per drafter and mode: measured and memory-bound cycle costs, break-even tau and, where
    the tau JSON has the method, the projected speedup. A testbed method `<name>_slim` (MoA with
    a slimmer LSA) is projected at the cost of `<name>`, which bounds its cost from above."""
    ms, bw = result["ms"], result["copy_bandwidth_gb_s"] * 1e9
    nbytes = result["bytes"]
    decode_lb = nbytes["target_step"] / bw * 1e3
    rows = []
    for name, d in ms["drafters"].items():
        modes: dict[str, tuple[float, float, int | None]] = {
            f"k{k}": (d[f"chain_k{k}"], ms[f"verify_k{k}"], k) for k in KS[1:]
        }
        modes[f"tree_d{TREE[0]}_b{TREE[1]}_m{TREE[2]}"] = (d["tree"], ms["verify_tree"], None)
        labels = [name] + [t for t in taus if t == f"{name}_slim"]
        for label in labels:
            for mode, (draft_ms, verify_ms, k) in modes.items():
                tau = taus.get(label, {}).get(mode)
                if label != name and tau is None:
                    continue
                # memory rows written per cycle = tokens verified = tau (3 where no tau is given)
                rows_per_cycle = min(MAX_ROWS, max(1, round(tau))) if tau else 3
                memory_ms = d.get(f"memory_rows_{rows_per_cycle}", 0.0)
                cycle = draft_ms + verify_ms + memory_ms
                b = nbytes["drafters"][name]
                steps = k if k is not None else TREE[0]  # a tree: one draft pass per depth
                memory_lb = b.get("memory_fixed", 0) + rows_per_cycle * b.get("memory_per_row", 0)
                cycle_lb = decode_lb + (steps * b["draft_step"] + memory_lb) / bw * 1e3
                row = {
                    "drafter": label,
                    "cost_of": name,
                    "mode": mode,
                    "propose_ms": draft_ms,
                    "verify_ms": verify_ms,
                    "memory_rows_ms": memory_ms,
                    "cycle_ms": cycle,
                    "break_even_tau": cycle / ms["decode"],
                    "memory_bound_cycle_ms": cycle_lb,
                    "memory_bound_break_even_tau": cycle_lb / decode_lb,
                    "tau": tau,
                }
                if tau:
                    row["projected_speedup"] = tau * ms["decode"] / cycle
                    row["memory_bound_projected_speedup"] = tau * decode_lb / cycle_lb
                rows.append(row)
    return rows


def load_taus(path: Path | None) -> dict[str, dict[str, float]]:
    """{method: {mode: tau}} from a benchmarks.testbed results JSON."""
    if path is None:
        return {}
    results = json.loads(path.read_text())["results"]
    return {
        name: {mode: r["tau"] for mode, r in modes.items() if isinstance(r, dict) and "tau" in r}
        for name, modes in results.items()
        if name != "plain"
    }


def plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = result["ms"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(ms["drafters"])
    parts = ["chain_k1", "chain_k4", "tree"]
    width = 0.8 / len(parts)
    for i, part in enumerate(parts):
        ax.bar(
            [j + i * width for j in range(len(names))],
            [ms["drafters"][n][part] / ms["decode"] for n in names],
            width,
            label=part,
        )
    ax.set_xticks([j + width for j in range(len(names))], names, rotation=20, fontsize=8)
    ax.set_ylabel("proposal time / plain decode step")
    ax.set_title(f"drafting cost (decode step {ms['decode']:.2f} ms)")
    ax.legend(fontsize=8)
    projected = [r for r in result["projection"] if "projected_speedup" in r]
    labels = [f"{r['drafter']} {r['mode']}" for r in projected]
    y = range(len(projected))
    ax2.barh([v + 0.2 for v in y], [r["projected_speedup"] for r in projected], 0.4, label="eager")
    ax2.barh(
        [v - 0.2 for v in y],
        [r["memory_bound_projected_speedup"] for r in projected],
        0.4,
        label="memory-bound",
    )
    ax2.set_yticks(list(y), labels, fontsize=7)
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("projected speedup over plain decoding (tau from --tau)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reproject(measured: Path, tau: Path | None, out: Path) -> dict[str, Any]:
    """A saved measurement's projection again with other taus (no GPU needed): the timings,
    machine and git SHA stay the measurement's; `projected_at` says where this file was made."""
    from benchmarks.results_paths import portable
    from benchmarks.testbed.report import git_sha

    result = json.loads(measured.read_text())
    result["projection"] = project(result, load_taus(tau))
    result["config"]["tau_source"] = str(tau) if tau else None
    result["projected_at"] = {"git_sha": git_sha(), "from": str(measured)}
    result = portable(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(out.with_suffix(".png"), result)
    return result


def _print(projection: list[dict[str, Any]]) -> None:
    for r in projection:
        speed = r.get("projected_speedup")
        print(
            f"{r['drafter']:14s} {r['mode']:16s} cycle {r['cycle_ms']:8.2f} ms  break-even tau "
            f"{r['break_even_tau']:.2f} (memory-bound {r['memory_bound_break_even_tau']:.2f})"
            + (f"  tau {r['tau']:.2f} -> {speed:.2f}x" if speed else "")
        )


def main(argv: list[str] | None = None) -> int:
    from benchmarks.testbed.report import add_out_argument, save_json

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_out_argument(p, "cost_model", type=Path)
    p.add_argument("--tau", type=Path, default=None, help="a benchmarks.testbed results JSON")
    p.add_argument("--context", type=int, default=1024, help="cached prefix length")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument(
        "--reproject",
        type=Path,
        default=None,
        metavar="MEASURED_JSON",
        help="measure nothing: re-project a saved cost-model JSON with --tau (no GPU needed)",
    )
    args = p.parse_args(argv)
    if args.reproject is not None:
        if not args.reproject.is_file():
            p.error(f"--reproject {args.reproject}: no such file")
        _print(reproject(args.reproject, args.tau, args.out)["projection"])
        return 0
    if args.context < 1:
        p.error("--context must be >= 1")
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA GPU: run with --smoke to check the script on the CPU")
    import_kernels()
    shape = SMOKE if args.smoke else LLAMA3_8B
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    taus = load_taus(args.tau)
    result = measure(shape, device, dtype, min(args.context, 64) if args.smoke else args.context)
    result["projection"] = project(result, taus)
    config = {
        "shape": shape.__dict__,
        "dtype": str(dtype),
        "context": args.context,
        "tree": dict(zip(("depth", "breadth", "nodes"), TREE, strict=True)),
        "tau_source": str(args.tau) if args.tau else None,
        "timer": "triton.testing.do_bench median" if device == "cuda" else "wall clock median",
    }
    save_json(args.out, "cost_model", {"config": config, **result})
    plot(args.out.with_suffix(".png"), result)
    _print(result["projection"])
    return 0 if all(math.isfinite(r["cycle_ms"]) for r in result["projection"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
