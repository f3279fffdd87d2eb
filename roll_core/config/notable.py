"""Defaults of roll that differ from the ones common elsewhere, and where they come from.

`roll validate` and `--dry-run` list the ones a resolved recipe uses, so a setup ported from
another trainer does not change silently. Each is a deliberate choice (docs/algorithms.md,
"Defaults that differ from other trainers'"); set the key to get the common value.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from roll_core.config.schema import OptimConfig


@dataclass(frozen=True)
class NotableDefault:
    """One setting whose value differs from the common default."""

    key: str
    value: str
    common: str
    source: str


def _optim_sections(model: BaseModel, prefix: str = "") -> Iterator[tuple[str, OptimConfig]]:
    """Every `OptimConfig` in a config tree, with its dotted key."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        key = f"{prefix}{name}"
        if isinstance(value, OptimConfig):
            yield key, value
        elif isinstance(value, BaseModel):
            yield from _optim_sections(value, key + ".")


def notable_defaults(cfg: Any) -> list[NotableDefault]:
    """The settings of `cfg` (a validated recipe) that differ from the common defaults."""
    out = [
        NotableDefault(
            f"{key}.betas",
            "(0.9, 0.95)",
            "(0.9, 0.999): torch.optim.AdamW, transformers' Trainer (TRL)",
            "the LLM-training convention of GPT-3 (arXiv 2005.14165) and LLaMA (arXiv "
            "2302.13971): a shorter second-moment memory, steadier with large updates",
        )
        for key, optim in _optim_sections(cfg)
        if tuple(optim.betas) == (0.9, 0.95)
    ]
    algo = getattr(cfg, "algorithm", None)
    if algo is None:
        return out
    if getattr(cfg, "_async_correction_default", False):
        out.append(
            NotableDefault(
                "algorithm.rollout_correction",
                "{preset: token_tis} (rollout.async_generation_ratio > 0)",
                "none: verl's and slime's importance-sampling corrections are opt-in",
                "async samples are up to async_generation_ratio policy versions old; "
                "uncorrected, 1 seed of 3 of the async benchmark collapsed (docs/rlvr.md, "
                "'Async training'); set it to null to train without a correction",
            )
        )
    if algo.kl.coef == 0.04:
        out.append(
            NotableDefault(
                "algorithm.kl.coef",
                "0.04 (preset grpo)",
                "0.0: TRL's GRPOConfig.beta (no reference model)",
                "DeepSeekMath's GRPO (arXiv 2402.03300, beta = 0.04); set it to 0 to drop the "
                "reference model",
            )
        )
    if algo.adv_estimator == "grpo" and algo.norm_adv_by_std != "none" and algo.adv_eps == 1e-6:
        out.append(
            NotableDefault(
                "algorithm.adv_eps",
                "1e-6",
                "1e-4: TRL's GRPOTrainer (std + 1e-4)",
                "verl's GRPO advantage (std + 1e-6); matters only for groups whose "
                "rewards barely differ",
            )
        )
    return out
