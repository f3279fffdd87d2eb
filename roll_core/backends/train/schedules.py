"""Learning-rate multipliers: linear warmup from 0, then cosine, linear or constant."""

from __future__ import annotations

import math


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
