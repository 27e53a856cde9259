"""The testbed's drafters (five by default) at one trainable parameter count, and their training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from benchmarks.testbed.presets import DEFAULT_MOA_REFRESH, TestbedConfig
from vllm_moa.drafters.eagle.model import EagleDrafter
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.drafters.griffin.model import GriffinDrafter
from vllm_moa.drafters.independent.model import IndependentDrafter
from vllm_moa.drafters.moa.config import MoAConfig
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.presets import (
    TargetInfo,
    make_config,
    make_eagle3_config,
    make_eagle_config,
    make_griffin_config,
    make_independent_config,
)
from vllm_moa.model.layers import count_parameters
from vllm_moa.training.config import TrainConfig

METHODS = ("moa_tli0", "moa_tli1", "moa_no_lsa", "eagle", "independent")
# On request (--methods): MoA with a slimmer LSA (MLP SLIM_LSA_MLP) whose parameters go to SA/CA
# at the same total. At E = 2*E_kv (the cpu testbed) the `small` LSA block is as large as SA or
# CA: LSA + Ekv2E take 38% of the budget (14% in the paper's 8B release); slim, 25%.
SLIM_METHODS = ("moa_tli0_slim", "moa_tli1_slim")
SLIM_LSA_MLP = 32
# On request: GRIFFIN's drafter (EAGLE + Token-Guided Fusion + Token-Enhanced Head), its layer's
# and its TGF's MLPs sized together to the budget (at the cpu preset's E = 256 that leaves them
# about 40% of EAGLE's MLP; see docs/training.md for the counts at the presets).
# On request: EAGLE-3 (three target states, its own LM head, the training-time test) with
# EAGLE's `small` layer, NOT at the budget: its LM head alone (E x V, 0.5M at the cpu preset's
# E = 256, V = 2048) is half the budget, and fc (3E x E) and the 2E-wide q/k/v the rest, so at
# the budget no MLP is left. Its parameter count is reported with its results.
EXTRA_METHODS = ("griffin", "eagle3")


def match_budget(build: Callable[[int], nn.Module], budget: int) -> nn.Module:
    """build(intermediate) whose parameter count is closest to budget (counts are linear)."""
    a, b = count_parameters(build(64))["total"], count_parameters(build(128))["total"]
    per_unit = (b - a) / 64
    size = max(8, round((budget - a) / per_unit / 8) * 8 + 64)
    return build(size)


def build_drafters(info: TargetInfo, seed: int, norm_init: str = "ones") -> dict[str, nn.Module]:
    moa0 = MoADrafter(make_config(info, "small", tli=0))
    budget = count_parameters(moa0)["total"]
    no_lsa = make_config(info, "small", memory_source="hidden")
    eagle = make_eagle_config(info, "small")
    griffin = make_griffin_config(info, "small")
    indep = make_independent_config(info, "small", num_layers=2)

    def moa_matched(config: MoAConfig) -> nn.Module:
        """`config` with SA/CA MLPs sized to the budget."""
        return match_budget(
            lambda i: MoADrafter(config.replace(sa_intermediate_size=i, ca_intermediate_size=i)),
            budget,
        )

    drafters: dict[str, nn.Module] = {
        "moa_tli0": moa0,
        "moa_tli1": MoADrafter(make_config(info, "small", tli=1)),
        **{
            f"moa_tli{tli}_slim": moa_matched(
                make_config(info, "small", tli=tli).replace(lsa_intermediate_size=SLIM_LSA_MLP)
            )
            for tli in (0, 1)
        },
        "moa_no_lsa": moa_matched(no_lsa),
        "eagle": match_budget(lambda i: EagleDrafter(eagle.replace(intermediate_size=i)), budget),
        "griffin": match_budget(
            lambda i: GriffinDrafter(griffin.replace(intermediate_size=i, tgf_intermediate_size=i)),
            budget,
        ),
        "independent": match_budget(
            lambda i: IndependentDrafter(indep.replace(intermediate_size=i)), budget
        ),
        "eagle3": Eagle3Drafter(make_eagle3_config(info, "small")),
    }
    for name, d in drafters.items():  # the MoA recipe's norm initialisation is MoA's
        d.init_weights(seed, norm_init=norm_init if name.startswith("moa") else "ones")  # type: ignore[operator]
    return drafters


def run_name(method: str, cfg: TestbedConfig) -> str:
    """Where a method's drafter is cached and reported: MoA trained with another K range than
    the default gets its own name (`moa_tli1_k3_8`), a drafter trained token-aligned too
    (`eagle_a3`, `griffin_a3t5`), and any drafter of another seed than the target's
    (`eagle_s1`, `moa_tli1_k3_8_a3_s1`), so they can be compared in one run."""
    name = method
    if method.startswith("moa") and cfg.moa_refresh != DEFAULT_MOA_REFRESH:
        name += f"_k{cfg.moa_refresh[0]}_{cfg.moa_refresh[1]}"
    if cfg.align_steps is not None and cfg.align_steps > 1:
        name += f"_a{cfg.align_steps}"
        if cfg.align_topk is not None and cfg.align_topk != 3:
            name += f"t{cfg.align_topk}"
        if cfg.align_stages:
            name += "st"
    if method.startswith("moa"):
        for option, tag in (("sa_staircase", "stair"), ("ca_memory", "ca"), ("norm_init", "norm")):
            value = getattr(cfg, option)
            if value != getattr(TestbedConfig, option):
                name += f"_{tag}{value}"
    if method == "eagle3" and cfg.head_init != "random":
        name += f"_head{cfg.head_init}"
    if cfg.seed_of_drafters != cfg.seed:
        name += f"_s{cfg.seed_of_drafters}"
    return name


def align_stages(cfg: TestbedConfig) -> list[TestbedConfig]:
    """The training stages of a drafter: one (the run's settings), or with `align_stages` GRIFFIN's
    schedule at the run's total steps: stage n of N = `align_steps` trains drafter_steps / N steps
    (the last one the remainder) with n passes, each from the stage before's drafter."""
    n = cfg.align_steps or 1
    if not cfg.align_stages:
        return [cfg]
    if n < 2 or cfg.drafter_steps < n:
        raise ValueError(
            f"staged alignment needs --align-steps >= 2 and at least that many drafter steps, "
            f"got {cfg.align_steps} passes over {cfg.drafter_steps} steps"
        )
    share = cfg.drafter_steps // n
    return [
        cfg.replace(
            drafter_steps=share if i < n else cfg.drafter_steps - share * (n - 1),
            align_steps=i if i > 1 else None,
            align_stages=False,
        )
        for i in range(1, n + 1)
    ]


def recipe_options(cfg: TestbedConfig) -> dict[str, Any]:
    """The MoA recipe's training options of a run (`TrainConfig`'s; the drafter's norm
    initialisation is `build_drafters`')."""
    return {"sa_staircase": cfg.sa_staircase, "ca_memory": cfg.ca_memory}


def drafter_train_config(
    cfg: TestbedConfig,
    target_dir: Path,
    corpus: list[Path],
    run: Path,
    init: Path,
    device: str = "cpu",
    method: str = "moa_tli0",
    skip_steps: int = 0,
) -> TrainConfig:
    """How the testbed trains every drafter (resuming from run/checkpoint.pt when present); the
    K range matters to MoA only (the other methods ignore it), the recipe's options are MoA's.
    `skip_steps`: the steps of the stages before (`align_stages`), whose data it continues."""
    return TrainConfig(
        target=str(target_dir),
        data=tuple(map(str, corpus)),
        out=str(run),
        max_steps=cfg.drafter_steps,
        drafter=str(init),
        seed=cfg.seed_of_drafters,
        lr=cfg.drafter_lr,
        batch_size=cfg.drafter_batch,
        max_length=cfg.seq_len,
        warmup_steps=max(1, cfg.drafter_steps // 20),
        save_every=max(1, cfg.drafter_steps // 5),
        log_every=max(1, cfg.drafter_steps // 50),
        eval_examples=16,
        refresh_min=cfg.moa_refresh[0],
        refresh_max=cfg.moa_refresh[1],
        align_steps=cfg.align_steps,
        align_topk=cfg.align_topk,
        **(recipe_options(cfg) if method.startswith("moa") else {}),
        resume=(run / "checkpoint.pt").is_file(),
        device=device,
        skip_steps=skip_steps,
    )
