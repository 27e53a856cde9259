"""Step 5: the training step on the card. The `paper`-preset MoA drafter (fp32 master weights,
bf16 autocast: the trainer's CUDA default) against a randomly initialised Llama-3-8B-shaped
target built in process (benchmarks/cost_model.py's; no checkpoint), on random token batches
of the trainer's default size (8 x 512): tokens/s (trained positions per second, the target's
forward included, as the trainer's progress bar counts them) and peak GPU memory.

The step is the trainer's own parts (`compute_loss`, the AdamW settings, gradient clipping);
only the data loader is replaced. Its first step is fed the batch as the trainer feeds it (on
the CPU: `collate`'s tensors) and recorded apart, then the batch moves to the device."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from benchmarks.cost_model import LLAMA3_8B, SMOKE, build_target
from benchmarks.gpu_check.common import StepContext, guarded, sync
from vllm_moa.devices import training_autocast
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.factories.methods import method_for
from vllm_moa.training.config import TrainConfig
from vllm_moa.training.data import Batch, Example, collate
from vllm_moa.training.schedule import step_generator
from vllm_moa.training.trainer import compute_loss


def random_batch(cfg: TrainConfig, vocab: int) -> Batch:
    """cfg.batch_size sequences of cfg.max_length random tokens, an eighth of each a prompt."""
    g = torch.Generator().manual_seed(0)
    n, prompt = cfg.max_length, cfg.max_length // 8
    ids = torch.randint(0, vocab, (cfg.batch_size, n), generator=g).tolist()
    mask = [i >= prompt for i in range(n)]
    return collate([Example(row, mask, prompt) for row in ids])


class Step:
    """One optimizer step of the trainer (`Trainer._step` with one micro-batch)."""

    def __init__(self, method: Any, target: Any, cfg: TrainConfig, device: str) -> None:
        self.method, self.target, self.cfg, self.device = method, target, cfg, device
        params = method.model.parameters()
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.count = 0

    def __call__(self, batch: Batch) -> tuple[float, int]:
        """(loss, trained positions); the loss read is the step's device sync, as the
        trainer's."""
        self.count += 1
        gen = step_generator(self.cfg.seed, self.count, 0)
        with training_autocast(self.device, self.cfg.autocast):
            with torch.no_grad():
                target_out = self.target.forward_batch(batch.input_ids, self.method.hidden_layers)
            out = compute_loss(self.method, self.target, batch, target_out, self.cfg, gen, False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.method.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out.loss.item(), out.tokens  # device sync


def run(ctx: StepContext) -> None:
    part, device = ctx.part, ctx.device
    shape = SMOKE if ctx.cpu else LLAMA3_8B
    cfg = TrainConfig(
        target="(random, built in process)",
        data=("(random tokens)",),
        out="(none)",
        max_steps=2 if ctx.cpu else 4,
        preset="paper",
        device=device,
        batch_size=2 if ctx.cpu else 8,  # 8 x 512: the trainer's defaults
        max_length=32 if ctx.cpu else 512,
    )
    began = time.perf_counter()
    target = build_target(shape, device, ctx.dtype)
    for p in target.model.parameters():
        p.requires_grad_(False)
    info = TargetInfo(target.shape, shape.num_heads, rope_theta=shape.rope_theta)
    drafter = MoADrafter(make_config(info, cfg.preset))
    drafter.init_weights(cfg.seed)
    method = method_for(drafter.to(device), target)
    part.figures.update(
        config={k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("target", "out")},
        target=shape.__dict__,
        target_dtype=str(ctx.dtype),
        drafter_parameters=sum(p.numel() for p in drafter.parameters()),
        build_s=time.perf_counter() - began,
    )
    if not ctx.cpu:
        part.figures["memory_after_build_gib"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    part.save()
    step = Step(method, target, cfg, device)
    batch = random_batch(cfg, shape.vocab_size)
    trainer_feed = guarded(part, "trainer_batch", lambda: step(batch))
    part.check("step_with_the_trainers_cpu_batch", trainer_feed is not None)
    batch = Batch(*(getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)))
    step(batch)  # warm-up (and the step the trainer's feed may not have made)
    sync(device)
    losses, tokens, t0 = [], 0, time.perf_counter()
    for _ in range(cfg.max_steps - 1):
        loss, n = step(batch)
        losses.append(loss)
        tokens += n
    seconds = time.perf_counter() - t0
    part.figures.update(
        losses=losses,
        step_s=seconds / len(losses),
        tokens_per_step=tokens // len(losses),
        tokens_per_second=tokens / seconds,
    )
    if not ctx.cpu:
        part.figures["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    part.check("losses_finite", all(math.isfinite(x) for x in losses))
