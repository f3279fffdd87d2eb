"""Learning-rate multipliers (linear warmup from 0, then cosine, linear or constant) and the
AdamW + schedule pair every trainable role builds from its `optim:` section."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from roll_core.config.schema import OptimConfig


def lr_multiplier(
    step: int, *, warmup_steps: int, total_steps: int, kind: str, min_ratio: float = 0.0
) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based: the first update is 0).

    Warmup: (step + 1) / warmup_steps for step < warmup_steps, so the first update already
    moves. Decay: from 1 at step = warmup_steps to `min_ratio` at step = total_steps - 1.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "linear":
        shape = 1.0 - progress
    elif kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown LR schedule {kind!r}; valid: cosine, linear, constant")
    return min_ratio + (1.0 - min_ratio) * shape


def adamw_kwargs(optim: OptimConfig) -> dict[str, Any]:
    """The AdamW hyper-parameters of an `optim:` section (lr, betas, eps, weight decay)."""
    return {
        "lr": optim.lr,
        "betas": optim.betas,
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }


def make_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying :func:`lr_multiplier` with the section's warmup and decay."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step,
            warmup_steps=optim.warmup_steps,
            total_steps=total_steps,
            kind=optim.scheduler,
            min_ratio=optim.min_lr_ratio,
        ),
    )


def make_optimizer(
    params: Iterable[torch.nn.Parameter], optim: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` and its LR schedule over `total_steps` optimizer steps.

    The multi-tensor (`foreach`) implementation on every device: bit-identical to the
    per-parameter loop (torch's CPU default), fewer kernel launches. `optim.fused` picks the
    fused kernel (CPU and CUDA): faster still, last-bit differences (docs/performance.md).
    """
    fused = True if optim.fused else None
    optimizer = torch.optim.AdamW(
        params, **adamw_kwargs(optim), foreach=not optim.fused, fused=fused
    )
    return optimizer, make_scheduler(optimizer, optim, total_steps)
