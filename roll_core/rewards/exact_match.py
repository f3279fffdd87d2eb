"""``exact_match``: 1.0 when the response equals the row's reference answer.

The comparison is on text, after the normalisations the recipe chooses (applied to both
sides, in this order): strip leading/trailing whitespace (on by default), collapse every run
of whitespace to one space, fold case. It is the strict reward other trainers' examples use
(TRL's GRPO examples compare the completion with the answer); ``math`` is more lenient (it
extracts the last number and compares values with math-verify).

``info``: ``correct`` (what ``eval/accuracy`` counts), ``format_ok`` (always true: there is no
format to miss).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from roll_core.config.reward_options import ExactMatchConfig
from roll_core.rewards.base import RewardResult, RewardSample

_WHITESPACE = re.compile(r"\s+")


def normalize(text: str, cfg: ExactMatchConfig) -> str:
    """``text`` after the normalisations of ``cfg``."""
    if cfg.strip:
        text = text.strip()
    if cfg.collapse_whitespace:
        text = _WHITESPACE.sub(" ", text)
    if cfg.ignore_case:
        text = text.casefold()
    return text


@dataclass(frozen=True)
class ExactMatchReward:
    """``exact_match``: 1.0 when ``normalize(response) == normalize(row[answer_key])``."""

    answer_key: str = "answer"
    exact_match: ExactMatchConfig | None = None

    def __call__(self, sample: RewardSample) -> RewardResult:
        if self.answer_key not in sample.row or sample.row[self.answer_key] is None:
            raise ValueError(f"the row has no {self.answer_key!r} column to compare with")
        cfg = self.exact_match or ExactMatchConfig()
        correct = normalize(sample.response, cfg) == normalize(
            str(sample.row[self.answer_key]), cfg
        )
        return RewardResult(1.0 if correct else 0.0, {"correct": correct, "format_ok": True})
