"""Distillation training of drafters against a frozen target (`vllm-moa train`)."""

from vllm_moa.training.config import TrainConfig
from vllm_moa.training.trainer import Trainer

__all__ = ["TrainConfig", "Trainer"]
