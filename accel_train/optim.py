"""Optimizer and learning-rate schedule (linear warmup, then cosine decay).

The schedule is a pure function of the optimizer step, stepped once per optimizer step by the
trainer (not by Accelerate's scheduler wrapper, which steps `num_processes` times per call), so
it is the same function on 1 process and on N.
"""

from __future__ import annotations

import math

import torch
from timm.optim import param_groups_weight_decay
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from .config import TrainConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate for the update made at optimizer step `step`
    (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    # No weight decay on biases and normalization weights (timm's and most recipes' choice).
    groups = param_groups_weight_decay(model, weight_decay=config.weight_decay)
    groups = [g for g in groups if any(p.requires_grad for p in g["params"])]
    for group in groups:
        group["params"] = [p for p in group["params"] if p.requires_grad]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.learning_rate)
    return torch.optim.SGD(groups, lr=config.learning_rate, momentum=config.momentum,
                           nesterov=config.momentum > 0)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int,
                    total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps, total_steps))


def plan_steps(config: TrainConfig, steps_per_epoch: int) -> tuple[int, int]:
    """(total optimizer steps, warmup steps) of the whole run."""
    total = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    warmup = round(config.warmup_epochs * steps_per_epoch)
    return total, min(warmup, total)
