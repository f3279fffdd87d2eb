"""The reward interface: one sample in, one :class:`RewardResult` out.

A reward function is any callable ``fn(sample: RewardSample) -> RewardResult | float``. It
sees the prompt and response text, the dataset row the prompt came from (``row["answer"]``,
``row["domain"]`` and any other column) and how generation ended (token count, finish
reason). It returns a score and an ``info`` dict of plain values that end up in metrics
(``correct``, ``format_ok``, ``extracted``, ...).

Reward functions are called as responses complete, possibly from several threads at once and,
by default, in worker processes (see :mod:`roll_core.rewards.execution`): they must not keep
mutable state between calls, and what they return must be picklable.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RewardFn", "RewardResult", "RewardSample", "as_result"]


@dataclass(frozen=True)
class RewardSample:
    """One finished response, as a reward function sees it.

    Attributes:
        prompt: the prompt text (after the chat template, as the model saw it, or the raw
            prompt column; whichever the caller has).
        response: the generated text, special tokens removed.
        row: the dataset row the prompt came from, with every column (``answer``,
            ``domain``, ...). Treat it as read-only.
        num_tokens: number of generated tokens.
        finish_reason: why generation stopped: ``"stop"`` (end of sequence or a stop
            string) or ``"length"`` (hit the token budget; the response is truncated).
    """

    prompt: str
    response: str
    row: Mapping[str, Any] = field(default_factory=dict)
    num_tokens: int = 0
    finish_reason: str = "stop"

    @property
    def domain(self) -> str | None:
        """The row's ``domain`` column as a string, or None when the row has none."""
        value = self.row.get("domain")
        return None if value is None else str(value)


@dataclass(frozen=True)
class RewardResult:
    """A reward: the ``score`` that is trained on and an ``info`` dict for metrics.

    Common ``info`` keys: ``correct`` (bool; feeds ``reward/<domain>/accuracy``),
    ``format_ok`` (bool), ``extracted`` (the answer string found, or None). The router adds
    ``error`` (None, or why the function failed) and ``timeout`` (bool).
    """

    score: float
    info: dict[str, Any] = field(default_factory=dict)


RewardFn = Callable[[RewardSample], "RewardResult | float"]
"""What a reward function is: ``fn(sample) -> RewardResult | float``."""


def as_result(value: object, *, source: str = "reward function") -> RewardResult:
    """Turn what a reward function returned into a :class:`RewardResult`.

    A real number (int, float, bool, numpy scalar) becomes ``RewardResult(float(value))``.
    Anything else, and a NaN or infinite score, raises :class:`TypeError` /
    :class:`ValueError` naming ``source``; the router counts that as an error of the sample.
    """
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, numbers.Real):
        result = RewardResult(float(value))
    else:
        raise TypeError(
            f"{source} returned {value!r} ({type(value).__name__}); "
            "return a float or a RewardResult(score, info)"
        )
    if not isinstance(result.score, numbers.Real) or not math.isfinite(result.score):
        raise ValueError(f"{source} returned a non-finite score {result.score!r}")
    if not isinstance(result.info, dict):
        raise TypeError(f"{source} returned info of type {type(result.info).__name__}; use a dict")
    if type(result.score) is not float:
        result = RewardResult(float(result.score), result.info)
    return result
