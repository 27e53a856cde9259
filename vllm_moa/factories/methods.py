"""Build the drafter a training run trains, its training method and its saver (where `generate
--drafter` reads it), and the trainer that takes them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from vllm_moa.checkpoint import load_drafter, save_drafter
from vllm_moa.hf_target.adapter import HFTarget
from vllm_moa.hf_target.info import load_target_info
from vllm_moa.kinds import BY_NAME, KINDS, kind_of
from vllm_moa.training.config import TrainConfig
from vllm_moa.training.data import Example
from vllm_moa.training.distributed import DistContext
from vllm_moa.training.methods import DraftMethod
from vllm_moa.training.trainer import Trainer


def new_drafter(cfg: TrainConfig) -> nn.Module:
    """A freshly initialised drafter of cfg.method, sized by cfg.preset for cfg.target (the
    kind's sizing function, from the registry, with the `train` options it takes)."""
    kind = BY_NAME[cfg.method]
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    options = {}
    for name in OPTIONS:
        value = getattr(cfg, name)
        if name in kind.options:
            options[name] = value
        elif value != defaults[name]:
            takers = [k.label or k.name for k in KINDS if name in k.options]
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} {value} applies to {' and '.join(takers)} only; drop it for "
                f"--method {cfg.method}"
            )
    info = load_target_info(cfg.target)
    drafter: nn.Module = kind.load("module")(kind.load("sizing")(info, cfg.preset, **options))
    drafter.init_weights(cfg.seed, norm_init=cfg.norm_init)  # type: ignore[operator]
    return drafter


def method_for(drafter: nn.Module, target: HFTarget, feature_noise: float = 0.0) -> DraftMethod:
    """The training forward of a drafter (EAGLE's feature noise applies only when a generator is
    passed to forward(), i.e. in training steps)."""
    method_class = kind_of(drafter).load("method")
    method: DraftMethod = method_class(drafter, target, feature_noise=feature_noise)
    return method


# `train` options a drafter kind's sizing may take (`DrafterKind.options`).
OPTIONS = ("tli", "memory_source", "draft_vocab")


def build_method(cfg: TrainConfig, target: HFTarget) -> DraftMethod:
    if cfg.drafter is not None:
        if cfg.head_init != "random":
            raise ValueError(new_drafter_only("--head-init"))
        drafter = load_drafter(cfg.drafter, target=target.shape)
        if cfg.draft_vocab is not None:
            resize_draft_vocab(drafter, cfg.draft_vocab)
    else:
        drafter = new_drafter(cfg)
        # A reduced draft vocabulary's head rows are the target's rows of its tokens, known
        # once the data is read (`prepare_drafter`).
        if cfg.head_init == "target" and cfg.draft_vocab is None:
            init_head_from_target(drafter, target)
    return method_for(drafter, target, cfg.feature_noise)


def new_drafter_only(flag: str) -> str:
    return f"{flag} sets up a new drafter; --drafter continues from a trained one: drop one of them"


def resize_draft_vocab(drafter: nn.Module, n: int) -> None:
    """`--drafter D --draft-vocab N`: MoA's draft vocabulary is an inference-time choice (the
    rows of the target's LM head its drafts read, no weights of its own), so a trained drafter
    takes a new one, of N tokens chosen from this run's data (`prepare_drafter`). EAGLE-3's
    sizes its own LM head: only a new drafter gets one."""
    resize = getattr(drafter, "set_draft_vocab_size", None)
    if resize is None:
        raise ValueError(new_drafter_only("--draft-vocab"))
    resize(n)


def trained_tokens(examples: Sequence[Example]) -> list[list[int]]:
    """Each example's tokens the loss trains on (its loss mask; never the first token)."""
    return [
        [t for i, (t, m) in enumerate(zip(e.input_ids, e.loss_mask, strict=True)) if m and i]
        for e in examples
    ]


def prepare_drafter(
    method: DraftMethod, examples: Sequence[Example], cfg: TrainConfig, target: HFTarget
) -> None:
    """Before the first step: `--draft-vocab N` sets the reduced draft vocabulary (EAGLE-3's,
    of a new drafter; MoA's, of a new or a continued one) from the training examples' trained
    tokens (`drafters/draft_vocab.py`), then `--head-init target` copies the target's rows of
    those tokens (EAGLE-3)."""
    if cfg.draft_vocab is None:
        return
    drafter = method.model
    # --draft-vocab is an option of the kinds whose drafters choose one (new_drafter and
    # build_method refuse it for the others): MoA's and EAGLE-3's `choose_draft_vocab`.
    vocab = drafter.choose_draft_vocab(trained_tokens(examples))  # type: ignore[operator]
    if vocab is not None:
        print(
            f"draft vocabulary: the {cfg.draft_vocab} most frequent of {vocab.distinct} distinct "
            f"trained tokens, {vocab.coverage:.2%} of the training data's trained tokens"
        )
    if cfg.head_init == "target":
        init_head_from_target(drafter, target)


def init_head_from_target(drafter: nn.Module, target: HFTarget) -> None:
    """A drafter with an LM head of its own (EAGLE-3) starts it, and its final norm, from the
    target's: `train --head-init target`."""
    init = getattr(drafter, "init_head_from", None)
    if init is None:
        label = kind_of(drafter).label or kind_of(drafter).name
        raise ValueError(
            f"--head-init target applies to drafters with an LM head of their own (EAGLE-3); "
            f"{label} reads the target's: drop it"
        )
    init(target.norm.weight, target.lm_head.weight)


def save_method_drafter(method: DraftMethod, out: Path, cfg: TrainConfig) -> Path:
    """The trained drafter, with the chain lengths MoA's bounded cross-attention was trained for
    (K ~ U[refresh_min, refresh_max]) and any token alignment recorded in its config.json."""
    training: dict[str, float] = {}
    if method.k_bounded:  # trained for chains of K ~ U[refresh_min, refresh_max]
        training = {"refresh_min": cfg.refresh_min, "refresh_max": cfg.refresh_max}
    align = cfg.alignment(kind_of(method.model).alignment)
    if align.steps > 1:
        training |= {"align_steps": align.steps, "align_topk": align.topk}
        if align.decay != 1:
            training |= {"align_decay": align.decay}
    if cfg.draft_vocab is not None:  # the vocabulary came from the data
        training |= {"draft_vocab": cfg.draft_vocab}
    return save_drafter(method.model, out, training=training or None)


def make_trainer(
    cfg: TrainConfig,
    dist: DistContext | None = None,
    make_method: Callable[[HFTarget], DraftMethod] | None = None,
) -> Trainer:
    """The trainer of the drafter `cfg` names (or of `make_method`'s, for ablations), saving it
    with the training facts `generate --drafter` and vLLM read."""
    if make_method is not None:
        return Trainer(cfg, make_method, lambda m, out: save_method_drafter(m, out, cfg), dist)
    return Trainer(
        cfg,
        lambda target: build_method(cfg, target),
        lambda method, out: save_method_drafter(method, out, cfg),
        dist,
        prepare=lambda method, examples, target: prepare_drafter(method, examples, cfg, target),
    )
