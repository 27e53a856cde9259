"""Pretrain a small target language model on local text (the testbed and demo targets)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM

from vllm_moa.devices import training_autocast
from vllm_moa.training.data import collate, epoch_batches, load_examples

# A testbed target trained 8 times over 1.35M tokens memorized them (training loss 3.20 -> 1.25,
# held-out 4.07 -> 3.97) and every drafter distilled on that text fell from tau ~2.4 to ~1.5.
MEMORIZING_EPOCHS = 4.0


def pretrain_target(
    target_dir: Path,
    files: list[Path],
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
    seed: int,
    device: str = "cpu",
) -> dict[str, float]:
    """Train the (randomly initialised) model in target_dir in place; returns loss/timing.

    fp32 weights; on CUDA the forward runs under bf16 autocast (fp32 master weights), as the
    drafter trainer does."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model: Any = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.to(device)
    model.train()
    autocast = training_autocast(device)
    examples = load_examples(files, tokenizer, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))),
    )
    torch.manual_seed(seed)
    per_epoch = epoch_batches(examples, batch, seed, 0)
    epochs = steps / len(per_epoch)
    if epochs > MEMORIZING_EPOCHS:
        print(
            f"warning: {steps} steps of {batch} go over the training text {epochs:.1f} times; "
            f"past about {MEMORIZING_EPOCHS} the target memorizes it (its loss there collapses, "
            "and drafters distilled on the same text learn that, not its held-out behaviour): "
            "give more text or fewer steps",
            flush=True,
        )
    t0, first, last = time.perf_counter(), None, 0.0
    for step in tqdm(range(steps), desc="target", mininterval=5.0):
        epoch, i = divmod(step, len(per_epoch))
        if i == 0 and epoch:
            per_epoch = epoch_batches(examples, batch, seed, epoch)
        b = collate([examples[j] for j in per_epoch[i]], tokenizer.pad_token_id)
        ids, attention = b.input_ids.to(device), b.attention_mask.to(device)
        with autocast:
            loss = model(
                input_ids=ids, attention_mask=attention, labels=ids.masked_fill(~attention, -100)
            ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        last = loss.item()  # device sync, once per step
        first = last if first is None else first
    model.eval()
    model.cpu().save_pretrained(target_dir)
    return {
        "first_loss": first or 0.0,
        "final_loss": last,
        "epochs": epochs,
        "seconds": time.perf_counter() - t0,
    }
