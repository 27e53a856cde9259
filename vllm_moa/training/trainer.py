"""The distillation loop: online target features, resumable checkpoints, metrics, evaluation.

Determinism: the batch order is a function of (seed, epoch) and every random draw of a step
(refresh intervals, feature noise) comes from a generator seeded with (seed, step, micro-batch),
so a run resumed from the checkpoint of step s logs the same losses as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vllm_moa.devices import training_autocast
from vllm_moa.hf_target.adapter import HFTarget, TargetOutput
from vllm_moa.kinds import kind_of
from vllm_moa.training.alignment import aligned_loss
from vllm_moa.training.config import Alignment, TrainConfig
from vllm_moa.training.data import Batch, Example, collate, epoch_batches, load_examples
from vllm_moa.training.distributed import DistContext
from vllm_moa.training.evaluation import evaluate
from vllm_moa.training.feature_cache import FeatureCache
from vllm_moa.training.losses import masked_kl, masked_smooth_l1, vocab_positions
from vllm_moa.training.methods import DraftMethod
from vllm_moa.training.schedule import (
    memory_limits,
    staircase_probability,
    staircase_rows,
    step_generator,
)

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


@dataclass
class StepLoss:
    loss: torch.Tensor  # scalar, differentiable
    kl: float
    feature: float
    tokens: int
    aligned: float | None = None  # --align-steps > 1: the fraction of positions the mask kept


def alignment_of(method: DraftMethod, cfg: TrainConfig) -> Alignment:
    """The run's token-aligned training: `train`'s flags, else the drafter kind's recipe."""
    return cfg.alignment(kind_of(method.model).alignment)


def compute_loss(
    method: DraftMethod,
    target: HFTarget,
    batch: Batch,
    target_out: TargetOutput,
    cfg: TrainConfig,
    gen: torch.Generator,
    staircase: float = 0.0,
) -> StepLoss:
    """The loss of one micro-batch; `staircase`: the probability that a sequence trains with
    SA's staircase (`schedule.staircase_probability`)."""
    seq = batch.input_ids.shape[1]
    if method.k_bounded:
        limits = memory_limits(batch.prompt_len, seq, cfg, gen, batch.loss_mask)
    else:  # fresh target information at every position (1-step bounded)
        limits = torch.arange(seq).expand(len(batch.prompt_len), seq)
    limits = limits.to(target.device)
    rows = staircase_rows(staircase, len(batch.prompt_len), gen) if method.k_bounded else None
    sa_from = None if rows is None else torch.where(rows.to(limits.device)[:, None], limits, 0)
    mask = batch.loss_mask.to(target.device)
    align = alignment_of(method, cfg)
    if align.steps > 1:  # token-aligned training (vllm_moa/training/alignment.py)
        passes = method.aligned(batch, target_out, limits, sa_from, gen, align.steps, align.topk)
        a = aligned_loss(
            passes, target_out.logits, mask, cfg.kl_weight, cfg.feature_weight, align.decay
        )
        return StepLoss(a.loss, a.kl, a.feature, a.tokens, a.kept)
    out = method.forward(batch, target_out, limits, sa_from, gen)
    if out.valid is not None:
        mask = mask & out.valid
    in_vocab = vocab_positions(target_out.logits, out.vocab)  # a reduced draft vocabulary
    if in_vocab is not None:
        mask = mask & in_vocab
    kl = masked_kl(target_out.logits, out.logits, mask, out.vocab)
    feature = sum(masked_smooth_l1(p, t, mask) for p, t in out.features) / max(1, len(out.features))
    loss = cfg.kl_weight * kl + cfg.feature_weight * feature
    feature_value = float(feature.detach()) if isinstance(feature, torch.Tensor) else 0.0
    return StepLoss(loss, kl.item(), feature_value, int(mask.sum().item()))  # device syncs


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at max_steps.

    Not transformers' get_cosine_with_min_lr_schedule_with_warmup: its decay is the same to the
    bit, but its warmup is step / warmup_steps (a first step at lr 0) where this one's is
    (step + 1) / warmup_steps, and checkpoints resume onto this schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        make_method: Callable[[HFTarget], DraftMethod],
        save: Callable[[DraftMethod, Path], Path],
        dist: DistContext | None = None,
        prepare: Callable[[DraftMethod, list[Example], HFTarget], None] | None = None,
    ) -> None:
        """`make_method` builds the training method on the loaded target and `save` writes its
        trained drafter to a directory: `vllm_moa.factories.methods.make_trainer` passes those of
        the drafter `cfg` names (cfg.drafter / cfg.method); ablations outside the product's
        methods pass their own. `prepare` readies the new drafter from the training examples
        before any step (EAGLE-3's reduced draft vocabulary, `--draft-vocab`)."""
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.dist = dist or DistContext.from_env(cfg.device)
        self.out = Path(cfg.out)
        self.target = HFTarget.from_pretrained(cfg.target, device=self.dist.device)
        for p in self.target.model.parameters():
            p.requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(cfg.target)
        examples = load_examples(cfg.data, tokenizer, cfg.max_length)
        held = min(cfg.eval_examples, len(examples) // 5)
        self.train_examples: list[Example] = examples[: len(examples) - held] or examples
        self.eval_examples: list[Example] = examples[len(examples) - held :]
        self.pad_id = tokenizer.pad_token_id or 0
        self.method = make_method(self.target)
        if prepare is not None:
            prepare(self.method, self.train_examples, self.target)
        # The run's token alignment resolved (the drafter kind's recipe where no flag was given),
        # so train_config.json records what the run did.
        self.cfg = cfg = cfg.with_alignment(kind_of(self.method.model).alignment)
        tli = int(getattr(getattr(self.method.model, "config", None), "tli", 0))
        if cfg.ca_memory == "release" and tli:
            raise ValueError(
                "ca_memory 'release' (the MoA authors' mask) is for TLI 0 drafters; "
                f"{cfg.drafter} has TLI {tli}: drop --ca-memory release"
            )
        self._save = save
        self.method.model.to(self.dist.device)
        # Forward passes go through the (possibly DDP-wrapped) module so gradients sync.
        self.method.module = self.dist.wrap(self.method.model)
        self.optimizer = torch.optim.AdamW(
            self.method.model.parameters(),
            lr=cfg.lr,
            betas=(0.9, 0.95),
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg)
        )
        self._epochs: dict[int, list[list[int]]] = {}
        self.cache: FeatureCache | None = None
        if cfg.offline_cache:
            if self.dist.is_main:  # one rank computes the features; the others then read them
                self._open_cache()
            self.dist.barrier()
            self._open_cache()

    def _open_cache(self) -> None:
        assert self.cfg.offline_cache is not None
        self.cache = FeatureCache.open_or_build(
            Path(self.cfg.offline_cache),
            self.target,
            self.cfg.target,
            self.train_examples,
            self.method.hidden_layers,
            batch_size=self.cfg.batch_size,
            workers=self.cfg.cache_workers,
        )

    def _target_output(self, batch: Batch, ids: list[int]) -> TargetOutput:
        """The frozen target's outputs on a batch: from the offline cache, or computed now."""
        if self.cache is not None:
            return self.cache.target_output(ids, self.target)
        with torch.no_grad():
            return self.target.forward_batch(batch.input_ids, self.method.hidden_layers)

    # ---- data ----
    def _batch(self, index: int) -> tuple[Batch, list[int]]:
        """The index-th micro-batch of the whole run (epochs reshuffled deterministically) and
        the indices of its examples."""
        per_epoch = len(self._epoch(0))
        epoch, i = divmod(index, per_epoch)
        ids = self._epoch(epoch)[i]
        return collate([self.train_examples[j] for j in ids], self.pad_id), ids

    def _epoch(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            self._epochs = {
                epoch: epoch_batches(self.train_examples, self.cfg.batch_size, self.cfg.seed, epoch)
            }
        return self._epochs[epoch]

    # ---- checkpoints ----
    def _save_checkpoint(self, step: int) -> None:
        if not self.dist.is_main:
            return
        state = {
            "step": step,
            "model": self.method.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": self.cfg.to_dict(),
        }
        tmp = self.out / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.out / CHECKPOINT)  # atomic: a kill never leaves half a checkpoint

    def _load_checkpoint(self) -> int:
        path = self.out / CHECKPOINT
        if not path.is_file():
            raise FileNotFoundError(f"--resume given but there is no {path}")
        state = torch.load(path, map_location=self.dist.device, weights_only=False)
        self.method.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return int(state["step"])

    def _open_metrics(self, start_step: int) -> Any:
        path = self.out / METRICS
        kept = []
        if start_step and path.is_file():  # drop what a killed run logged after its checkpoint
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= start_step
            ]
        path.write_text("".join(line + "\n" for line in kept))
        return path.open("a")

    # ---- the loop ----
    def train(self) -> Path:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:
            cfg.save(self.out / "train_config.json")
        start = self._load_checkpoint() if cfg.resume else 0
        metrics = self._open_metrics(start) if self.dist.is_main else None
        bar = tqdm(
            total=cfg.max_steps,
            initial=start,
            disable=not self.dist.is_main,
            dynamic_ncols=True,
            mininterval=2.0,
            desc="train",
        )
        t0, tokens = time.perf_counter(), 0
        for step in range(start + 1, cfg.max_steps + 1):
            record = self._step(step)
            tokens += record.pop("tokens")
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['loss']:.4f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}"
            )
            log = step % cfg.log_every == 0 or step == cfg.max_steps
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps:
                record.update(self._evaluate())
                log = True
            if log and metrics is not None:
                record.update(step=step, tokens_per_second=tokens / (time.perf_counter() - t0))
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if cfg.save_every and step % cfg.save_every == 0:
                self._save_checkpoint(step)
        bar.close()
        self._save_checkpoint(cfg.max_steps)
        if metrics is not None:
            metrics.close()
        return self._finish()

    def _step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        self.method.model.train()
        staircase = staircase_probability(step, cfg)
        totals = {"loss": 0.0, "kl": 0.0, "feature": 0.0, "tokens": 0}
        if alignment_of(self.method, cfg).steps > 1:
            totals["aligned"] = 0.0
        autocast = self._autocast()
        stream = step + cfg.skip_steps  # the step's place in the data stream
        for micro in range(cfg.grad_accum):
            index = ((stream - 1) * cfg.grad_accum + micro) * self.dist.world + self.dist.rank
            gen = step_generator(cfg.seed, stream, micro * self.dist.world + self.dist.rank)
            batch, ids = self._batch(index)
            with autocast:
                target_out = self._target_output(batch, ids)
                out = compute_loss(self.method, self.target, batch, target_out, cfg, gen, staircase)
            (out.loss / cfg.grad_accum).backward()
            totals["loss"] += out.loss.item() / cfg.grad_accum  # device sync, once per micro-batch
            totals["kl"] += out.kl / cfg.grad_accum
            totals["feature"] += out.feature / cfg.grad_accum
            if out.aligned is not None:
                totals["aligned"] += out.aligned / cfg.grad_accum
            totals["tokens"] += out.tokens
        torch.nn.utils.clip_grad_norm_(self.method.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        reduced = self.dist.mean({k: float(v) for k, v in totals.items() if k != "tokens"})
        return {**reduced, "lr": self.scheduler.get_last_lr()[0], "tokens": totals["tokens"]}

    def _autocast(self) -> Any:
        return training_autocast(self.dist.device, self.cfg.autocast)

    def _evaluate(self) -> dict[str, Any]:
        if not self.eval_examples:
            return {}
        self.method.model.eval()
        with torch.no_grad(), self._autocast():
            result = evaluate(self.method, self.target, self.eval_examples, self.cfg, self.pad_id)
        return {f"eval_{k}": v for k, v in result.items()}

    def _finish(self) -> Path:
        drafter_dir = self.out / "drafter"
        if self.dist.is_main:
            self._save(self.method, drafter_dir)
            from vllm_moa.training.plot import plot_metrics

            plot_metrics(self.out / METRICS, self.out / "metrics.png")
        self.dist.barrier()
        return drafter_dir
