"""The optimizer of a training run and its learning-rate schedule, both from the training config (the DeepSpeed JSON
sets neither): torch AdamW (nothing to compile) with weight decay on matrices only, and a linear warmup then a
cosine decay to min_lr_ratio. A resumed run may change `steps` only where that leaves the learning rates of the
steps already taken as they were (schedule_so_far_unchanged, asked by train/checks.py check_resume)."""

from __future__ import annotations

import dataclasses
import math

from train.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr for optimizer step `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_so_far_unchanged(cfg: TrainConfig, old_steps: int, done: int) -> bool:
    """Whether the learning rates of the `done` steps taken and of the next one are the same under the run's old
    `steps` (the other schedule settings cannot have changed): then extending or shortening the run is exact."""
    old = dataclasses.replace(cfg, steps=old_steps)
    return all(lr_factor(step, old) == lr_factor(step, cfg) for step in range(done + 1))


def param_groups(model, weight_decay: float):
    """Trainable parameters; decay only matrices (norm weights, biases, gates and SSM A_log/D/dt_bias are 1-d)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # ZeRO drops empty groups, and the LR schedule must match its count


def build_optimizer(model, cfg: TrainConfig):
    """(optimizer, scheduler) of `model`'s trainable parameters: AdamW over param_groups, stepped by lr_factor."""
    import torch

    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
        fused=torch.cuda.is_available(),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    return optimizer, scheduler
