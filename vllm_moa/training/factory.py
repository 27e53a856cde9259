"""Build the drafter a training run trains, and save it where `generate --drafter` reads it."""

from __future__ import annotations

from pathlib import Path

from vllm_moa.checkpoint import load_drafter, save_drafter
from vllm_moa.model import MoADrafter, make_config
from vllm_moa.target.adapter import HFTarget
from vllm_moa.target.info import load_target_info
from vllm_moa.training.config import TrainConfig
from vllm_moa.training.methods import DraftMethod, MoAMethod


def build_method(cfg: TrainConfig, target: HFTarget) -> DraftMethod:
    if cfg.drafter is not None:
        drafter = load_drafter(cfg.drafter, target=target.shape)
        return MoAMethod(drafter, target)
    if cfg.method == "moa":
        info = load_target_info(cfg.target)
        config = make_config(info, cfg.preset, tli=cfg.tli, memory_source=cfg.memory_source)
        drafter = MoADrafter(config)
        drafter.init_weights(cfg.seed)
        return MoAMethod(drafter, target)
    raise ValueError(f"method {cfg.method!r} is not trainable yet")


def save_method_drafter(method: DraftMethod, out: Path) -> Path:
    model = method.model
    if isinstance(model, MoADrafter):
        return save_drafter(model, out)
    raise TypeError(f"cannot save a {type(model).__name__}")
