"""Optimiser parameter groups and learning-rate schedules (all with linear warmup)."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

SCHEDULES = ("inverse_sqrt", "cosine", "constant")


def param_groups(
    backbone: Iterable[nn.Parameter],
    heads: Iterable[nn.Parameter],
    lr: float,
    weight_decay: float = 0.0,
    head_lr_mult: float = 1.0,
) -> list[dict[str, Any]]:
    """Trainable parameters only (frozen ones never reach the optimiser); no weight decay on vectors
    (norm gains, biases); heads get their own learning-rate multiplier."""
    groups = []
    for name, params, mult in (("backbone", backbone, 1.0), ("heads", heads, head_lr_mult)):
        params = [p for p in params if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        for suffix, ps, wd in (("", decay, weight_decay), ("_no_decay", no_decay, 0.0)):
            if ps:
                groups.append({"name": name + suffix, "params": ps, "lr": lr * mult, "weight_decay": wd})
    if not groups:
        raise ValueError("no trainable parameters: everything is frozen")
    return groups


def lr_lambda(
    name: str, warmup_steps: int, total_steps: int | None = None, min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at optimiser step `step` (0-based, as LambdaLR counts)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    warmup = max(0, int(warmup_steps))

    def f(step: int) -> float:
        s = step + 1
        if warmup and s <= warmup:
            return s / warmup
        if name == "constant":
            return 1.0
        if name == "inverse_sqrt":
            return math.sqrt(max(warmup, 1) / s)
        if not total_steps or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (s - warmup) / (total_steps - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_optimizer(
    optimizer_factory: Callable[..., torch.optim.Optimizer],
    groups: list[dict[str, Any]],
    schedule: Mapping[str, Any],
    total_steps: int | None,
) -> dict[str, Any]:
    """Lightning's configure_optimizers dict: the optimiser and a per-step LambdaLR."""
    opt = optimizer_factory(groups)
    f = lr_lambda(
        schedule.get("name", "inverse_sqrt"),
        schedule.get("warmup_steps", 0),
        total_steps,
        schedule.get("min_lr_ratio", 0.0),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
