"""Which target information should the Cross-Attention memory hold?

    python -m benchmarks.memory_ablation --testbed ~/.cache/vllm_moa/testbed-cpu \
        --prompts ../shared/data/HumanEval.jsonl.gz \
        --out benchmarks/results/memory_ablation/memory_ablation_cpu.json

On a testbed built by `benchmarks.testbed` (its target and its trained `moa_tli0` and
`moa_no_lsa` drafters), trains more TLI=0 drafters with the testbed's data, steps, batch and
seed, each changing one thing about where the Cross-Attention memory comes from:
- `hidden_j` (the `moa_no_lsa` shape and parameter count): memory rows are the input of target
  layer j (HF's hidden_states[j], before the final norm); j = L - 1 is the last layer's input,
  the deepest state LSA's K|V are computed from;
- `lsa_last_layer` (the `moa_tli0` drafter exactly): LSA over the last layer's K|V row only;
- `lsa_last_row` (likewise): LSA over every layer, read out at the last layer's row instead of
  the mean over layers;
- `lsa_on_hidden_{L-1}` (likewise; needs E = 2*E_kv, true of the cpu testbed): LSA over one row,
  the last layer's input hidden state instead of that layer's K|V computed from it: the same
  drafter and parameters as `lsa_last_layer`, only the input differs.
All are scored teacher-forced on the target's own greedy continuations of the prompts, with
s = 0..K-1 stale steps, like `benchmarks.positions`. Beside them, the target's own "logit lens":
top-1 agreement of lm_head(norm(hidden_j)) with its final prediction (no training), i.e. how much
of the next token the first j layers have decided. If MoA's LSA trailed the final hidden state
because LSA never sees the last layer's computation, `hidden_{L-1}` would fall to LSA's level;
the `lsa_*` variants locate what else LSA loses (the pooling over layers, or its processing),
and `hidden_{L-1}_small` (`hidden_{L-1}` with MoA TLI=0's smaller SA/CA MLPs, i.e. without the
parameters LSA + Ekv2E take from the equal budget) what that budget share costs, and `lsa_slim`
(MoA TLI=0 with LSA's MLP cut to 32, SA/CA MLPs grown back to the same total: LSA + Ekv2E 25% of
the budget instead of 38%) whether giving LSA a smaller share recovers it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.positions import greedy_examples, teacher_forced
from benchmarks.testbed.drafters import build_drafters, drafter_train_config
from benchmarks.testbed.presets import PRESETS
from benchmarks.testbed.report import add_out_argument, save_json
from vllm_moa.checkpoint import load_drafter, save_drafter
from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.drafters.moa.method import MoAMethod
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.factories.methods import method_for
from vllm_moa.hf_target import HFTarget, load_target_info
from vllm_moa.hf_target.adapter import TargetOutput
from vllm_moa.model.layers import count_parameters
from vllm_moa.training.data import Example, collate


class ReadoutLSA(MoADrafter):
    """Ablation only: LSA over the last `num_rows` layers' K|V, read out by `readout` ("mean" as
    MoA does, or "last": the last layer's row). Same weights and checkpoint keys as MoADrafter."""

    def __init__(self, config: MoAConfig, num_rows: int | None, readout: str) -> None:
        super().__init__(config)
        self.num_rows, self.readout = num_rows, readout

    def encode_memory(self, features: torch.Tensor) -> torch.Tensor:
        rows = features if self.num_rows is None else features[:, -self.num_rows :]
        lsa = self.layer_self_attention
        layers = torch.arange(rows.shape[1], device=rows.device)
        k, v = lsa.kv_from(rows, layers)
        h = lsa(rows, layers, k, v, None)
        return self.Ekv2E(h.mean(dim=1) if self.readout == "mean" else h[:, -1])


@dataclasses.dataclass(frozen=True)
class Variant:
    shape_of: str  # the testbed drafter whose shape, parameter count and initialisation it takes
    memory_layer: int | None = None  # hidden_j: memory rows = hidden_states[j]
    lsa_rows: int | None = None  # LSA over the last lsa_rows layers only (None: all)
    readout: str = "mean"  # LSA readout: "mean" over layers, or the "last" layer's row
    lsa_on_hidden: bool = False  # LSA reads hidden_states[memory_layer] as its one row
    mlp_of: str | None = None  # SA/CA MLP sizes from this testbed drafter (fewer parameters)

    def drafter(self, base: MoADrafter) -> MoADrafter:
        if not base.uses_lsa:
            return base
        variant = ReadoutLSA(base.config, self.lsa_rows, self.readout)
        variant.load_state_dict(base.state_dict())
        return variant

    def method(self, drafter: MoADrafter, target: HFTarget) -> MoAMethod:
        if self.lsa_on_hidden:
            return HiddenRowMethod(drafter, target, memory_layer=self.memory_layer)
        return MoAMethod(drafter, target, memory_layer=self.memory_layer)


class HiddenRowMethod(MoAMethod):
    """Ablation only: an LSA drafter fed hidden_states[memory_layer] [B, T, E] as a single
    layer row [B, T, 1, E] in place of the K|V rows (needs E == 2 * E_kv)."""

    def __init__(self, drafter: MoADrafter, target: HFTarget, memory_layer: int | None) -> None:
        super().__init__(drafter, target, memory_layer)
        self.hidden_layers = tuple(sorted({*self.hidden_layers, self.memory_layer}))

    def memory_features(self, target_out: TargetOutput) -> torch.Tensor:
        return target_out.hidden_states[self.memory_layer][:, :, None, :]


def variants(hidden: list[int], num_layers: int, square: bool) -> dict[str, Variant]:
    """square: the target's E == 2 * E_kv (LSA can read a hidden state as a row)."""
    out = {
        **{f"hidden_{j}": Variant("moa_no_lsa", memory_layer=j) for j in hidden},
        "lsa_last_layer": Variant("moa_tli0", lsa_rows=1),
        "lsa_last_row": Variant("moa_tli0", readout="last"),
    }
    j = num_layers - 1
    if square:
        out[f"lsa_on_hidden_{j}"] = Variant("moa_tli0", memory_layer=j, lsa_on_hidden=True)
    # hidden_{L-1} with MoA TLI=0's SA/CA sizes: what the parameters LSA takes cost SA and CA
    out[f"hidden_{j}_small"] = Variant("moa_no_lsa", memory_layer=j, mlp_of="moa_tli0")
    # MoA with a slimmer LSA (MLP 32), its parameters moved to SA/CA at the same total
    out["lsa_slim"] = Variant("moa_tli0_slim")
    return out


def train_variant(
    testbed: Path, preset: str, name: str, variant: Variant
) -> tuple[MoADrafter, dict[str, Any]]:
    """Train (or reload) one ablation drafter; returns it ready to evaluate, and its stats."""
    from vllm_moa.factories.methods import make_trainer
    from vllm_moa.tiny import stdlib_sources

    cfg = PRESETS[preset]
    target_dir = testbed / "target"
    run = testbed / "ablation" / name
    done = run / "done.json"
    if not done.is_file():
        testbed_drafters = build_drafters(load_target_info(target_dir), cfg.seed)
        base = testbed_drafters[variant.shape_of]
        assert isinstance(base, MoADrafter)
        if variant.mlp_of is not None:
            sized = testbed_drafters[variant.mlp_of]
            assert isinstance(sized, MoADrafter)
            sizes = sized.config
            base = MoADrafter(
                base.config.replace(
                    sa_intermediate_size=sizes.sa_intermediate_size,
                    ca_intermediate_size=sizes.ca_intermediate_size,
                )
            )
            base.init_weights(cfg.seed)
        drafter = variant.drafter(base)
        init = save_drafter(drafter, run / "init")
        t0 = time.perf_counter()
        make_trainer(
            drafter_train_config(cfg, target_dir, stdlib_sources(cfg.corpus_bytes), run, init),
            make_method=lambda target: variant.method(drafter, target),
        ).train()
        stats = {
            "parameters": count_parameters(drafter)["total"],
            "train_seconds": time.perf_counter() - t0,
        }
        done.write_text(json.dumps(stats))
    trained = load_drafter(run / "drafter", load_target_info(target_dir).shape)
    assert isinstance(trained, MoADrafter)
    return variant.drafter(trained), json.loads(done.read_text())


@torch.no_grad()
def logit_lens(target: HFTarget, examples: list[Example]) -> dict[int, float]:
    """Top-1 agreement of lm_head(norm(hidden_j)) with the target's prediction, per j < L."""
    num_layers = target.shape.num_layers
    hits, count = torch.zeros(num_layers), 0
    for ex in examples:
        batch = collate([ex])
        out = target.forward_batch(batch.input_ids, range(num_layers))
        want = out.logits.argmax(-1)[0]
        scored = batch.loss_mask[0].to(want.device)
        for j in range(num_layers):
            guess = target.lm_head(target.norm(out.hidden_states[j])).argmax(-1)[0]
            hits[j] += (guess == want)[scored].sum().cpu()
        count += int(scored.sum())
    return {j: float(hits[j] / max(1, count)) for j in range(num_layers)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--testbed", type=Path, required=True, help="a benchmarks.testbed --out dir")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="the testbed's")
    p.add_argument("--prompts", type=Path, required=True)
    add_out_argument(p, "memory_ablation", type=Path)
    p.add_argument(
        "--layers", type=int, nargs="+", default=None, help="hidden_j variants; default L-1, L-2"
    )
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    testbed = args.testbed.expanduser()
    target_dir = testbed / "target"
    shape = load_target_info(target_dir).shape
    num_layers = shape.num_layers
    layers = args.layers or [num_layers - 1, num_layers - 2]
    if not all(0 <= j < num_layers for j in layers):
        p.error(f"--layers must lie in [0, {num_layers - 1}] (the target has {num_layers} layers)")
    for name in ("moa_tli0", "moa_no_lsa"):
        if not (testbed / "drafters" / name / "drafter").is_dir():
            p.error(f"{testbed} has no trained {name}: run benchmarks.testbed on it first")
    ablations = variants(
        layers, num_layers, shape.hidden_size == 2 * shape.num_kv_heads * shape.head_dim
    )
    trained = {
        name: train_variant(testbed, args.preset, name, variant)
        for name, variant in ablations.items()
    }

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = HFTarget.from_pretrained(target_dir)
    _, _, examples = greedy_examples(
        target, tokenizer, args.prompts, args.num_prompts, args.max_tokens
    )
    figures: dict[str, Any] = {}
    runs = testbed / "drafters"
    evaluated: list[tuple[str, MoAMethod, dict[str, Any]]] = []
    for label, name in (("lsa (moa_tli0)", "moa_tli0"), ("hidden_final", "moa_no_lsa")):
        drafter = load_drafter(runs / name / "drafter", target.shape)
        evaluated.append((label, method_for(drafter, target), {}))  # type: ignore[arg-type]
    for name, (drafter, stats) in trained.items():
        evaluated.append((name, ablations[name].method(drafter, target), stats))
    for name, method, stats in evaluated:
        method.model.eval()
        agreement = teacher_forced(method, target, examples, args.k)
        figures[name] = {"teacher_forced_agreement_per_stale_step": agreement, **stats}
        print(name, [round(a, 3) for a in agreement], flush=True)
    lens = logit_lens(target, examples)
    print("logit lens", {j: round(a, 3) for j, a in lens.items()})
    config = {
        "testbed": str(args.testbed),
        "preset": args.preset,
        "layers": layers,
        "prompts": str(args.prompts),
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "k": args.k,
    }
    report = {"config": config, "figures": figures, "logit_lens_agreement": lens}
    save_json(args.out, "memory_ablation", report)
    plot(args.out.with_suffix(".png"), figures, lens, num_layers)
    return 0


def plot(path: Path, figures: dict[str, Any], lens: dict[int, float], num_layers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, f in figures.items():
        agreement = f["teacher_forced_agreement_per_stale_step"]
        ax.plot(range(1, len(agreement) + 1), agreement, "-o", label=name)
    ax.set_xlabel("draft position (stale steps + 1)")
    ax.set_ylabel("teacher-forced top-1 agreement")
    ax.set_title("CA memory source (TLI=0)")
    ax.legend(fontsize=8)
    ax2.plot([*lens, num_layers], [*lens.values(), 1.0], "-o")
    ax2.set_xlabel("layers run (j)")
    ax2.set_ylabel("agreement with the final prediction")
    ax2.set_title("target's logit lens: lm_head(norm(hidden_j))")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
