"""Pretrain a small target language model on local text (the testbed and demo targets)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM

from vllm_moa.training.data import collate, epoch_batches, load_examples


def pretrain_target(
    target_dir: Path, files: list[Path], steps: int, batch: int, seq_len: int, lr: float, seed: int
) -> dict[str, float]:
    """Train the (randomly initialised) model in target_dir in place; returns loss/timing."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.train()
    examples = load_examples(files, tokenizer, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))),
    )
    torch.manual_seed(seed)
    per_epoch = epoch_batches(examples, batch, seed, 0)
    t0, first, last = time.perf_counter(), None, 0.0
    for step in tqdm(range(steps), desc="target", mininterval=5.0):
        epoch, i = divmod(step, len(per_epoch))
        if i == 0 and epoch:
            per_epoch = epoch_batches(examples, batch, seed, epoch)
        b = collate([examples[j] for j in per_epoch[i]], tokenizer.pad_token_id)
        labels = b.input_ids.masked_fill(~b.attention_mask, -100)
        loss = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        last = loss.item()  # device sync, once per step
        first = last if first is None else first
    model.eval()
    model.save_pretrained(target_dir)
    return {"first_loss": first or 0.0, "final_loss": last, "seconds": time.perf_counter() - t0}
