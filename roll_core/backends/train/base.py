"""The TrainBackend interface. `torch` implements it now; FSDP2 and DeepSpeed join later."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from roll_core.data import Batch


def is_max_metric(key: str) -> bool:
    """Objective metrics named ``*_max`` are maxima: micro-batches and ranks combine them by
    max; every other objective metric is a sum (of shares of a global mean)."""
    return key.endswith("_max")


def add_metrics(sums: dict[str, float], metrics: dict[str, Any]) -> None:
    """Accumulate one micro-batch's objective metrics into ``sums`` (see :func:`is_max_metric`)."""
    for key, value in metrics.items():
        if is_max_metric(key) and key in sums:
            sums[key] = max(sums[key], float(value))
        else:
            sums[key] = sums.get(key, 0.0) + float(value)


class TrainBackend(Protocol):
    """Owns a model and its optimizer on one rank."""

    model: torch.nn.Module
    device: torch.device

    def train_step(self, batch: Batch, objective: Any) -> dict[str, float]:
        """One optimizer step over `batch`, accumulated in micro-batches.

        `objective(logits, micro_batch) -> (loss share, metric sums)` normalises with the
        global counts in `batch.meta` (e.g. `loss_tokens` over all ranks), so accumulation and
        data parallelism give the same update as one big batch.
        """
        ...

    def evaluate(self, batch: Batch, objective: Any) -> dict[str, float]:
        """Summed objective metrics on `batch` (no update)."""
        ...

    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """Next-token log-probs [B, T-1] (float32, CPU)."""
        ...

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation token ids for each prompt (no prompt tokens, no padding)."""
        ...

    def save(self, path: Path) -> None:
        """Write the full training state (model in HF format, optimizer, scheduler, RNG)."""
        ...

    def load(self, path: Path) -> None:
        """Restore exactly what `save` wrote."""
        ...

    def export(self, path: Path) -> None:
        """Write the model and tokenizer in Hugging Face format."""
        ...

    def state_digest(self) -> str:
        """sha256 over every parameter's bytes (exactness checks)."""
        ...
