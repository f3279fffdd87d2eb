"""Format reward: 1.0 when the whole response matches a regex, else 0.0.

The default pattern is the R1-style structure ``<think>...</think><answer>...</answer>``:
exactly one think block followed by exactly one answer block, whitespace allowed between and
around them, nothing else. Any pattern can be configured; it must match the *whole* response
(:func:`re.fullmatch`) and ``.`` matches newlines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from roll_core.errors import ConfigError
from roll_core.rewards.base import RewardResult, RewardSample

__all__ = ["DEFAULT_FORMAT_PATTERN", "FormatReward"]

DEFAULT_FORMAT_PATTERN = (
    r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*"
)
"""One ``<think>`` block, then one ``<answer>`` block, nothing else (tags do not nest)."""


@dataclass(frozen=True)
class FormatReward:
    """1.0 when ``pattern`` matches the whole response, else 0.0; ``info["format_ok"]``.

    Args:
        pattern: a Python regex matched against the whole response with ``re.DOTALL``
            (None: :data:`DEFAULT_FORMAT_PATTERN`).
    """

    pattern: str | None = None
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        source = DEFAULT_FORMAT_PATTERN if self.pattern is None else self.pattern
        try:
            compiled = re.compile(source, re.DOTALL)
        except re.error as err:
            raise ConfigError(
                f"format pattern {source!r} is not a valid regular expression: {err}.",
                hint=r"Example: '.*Answer: \d+' (it must match the whole response).",
            ) from None
        object.__setattr__(self, "_compiled", compiled)

    def __call__(self, sample: RewardSample) -> RewardResult:
        ok = self._compiled.fullmatch(sample.response) is not None
        return RewardResult(1.0 if ok else 0.0, {"format_ok": ok})
