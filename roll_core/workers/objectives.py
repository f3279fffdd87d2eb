"""Training objectives: adapters from a micro-batch to the pure losses.

An objective is called by the train backend once per micro-batch with the logits and the
micro-batch, and returns (this micro-batch's share of the global loss, metric sums). Global
normalisers (e.g. `loss_tokens`, the trained tokens of the whole global batch across ranks)
travel in `batch.meta`, so gradient accumulation and data parallelism give the update of one
big batch. Workers pick objectives by name; they are the registry's only entries point.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from roll_core.backends.train.torch_backend import Objective, token_loss_sum
from roll_core.data import Batch
from roll_core.errors import ConfigError


def sft(logits: torch.Tensor, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean next-token cross-entropy on response tokens over the global batch."""
    ids, mask = mb.tensors["input_ids"], mb.tensors["loss_mask"]
    summed = token_loss_sum(logits, ids, mask)
    loss = summed / float(mb.meta["loss_tokens"])
    return loss, {
        "train/loss_sum": float(summed.detach()),
        "train/loss_tokens": float(mask[:, 1:].sum()),
    }


OBJECTIVES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {"sft": sft}
"""Objective name -> function(logits, mb, **params). Pipelines add theirs here."""


def get_objective(name: str, **params: Any) -> Objective:
    """The objective `name` with its parameters bound."""
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; valid: {', '.join(OBJECTIVES)}.")
    return functools.partial(OBJECTIVES[name], **params)
