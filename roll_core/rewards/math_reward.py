"""Math rule reward: extract the final answer, check it against the reference with math-verify.

Why math-verify (Hugging Face, used by open-r1 and lighteval): it parses LaTeX and plain
expressions into SymPy and compares them numerically and symbolically, so ``1/2``, ``0.5``
and ``\\frac{1}{2}`` are the same answer, ``1,000`` is ``1000``, sets, intervals and matrices
compare correctly. A hand-written normaliser gets a fraction of these cases right.

What we do around it:

* **Extraction.** Only the text after the last ``</think>`` is graded (a response that opens
  ``<think>`` and never closes it has no final answer). Then the last ``\\boxed{...}`` wins
  (every box, as a set, when the reference has several boxes); without one, the configured
  ``answer_pattern`` (a regex: named group ``answer``, else group 1, else the whole match,
  last match wins) or, by default, the last number in the text (``"The answer is 68."`` ->
  ``68``, ``-5``, ``3.25``, ``1,000``, ``1/2``, ``1:2``, ``4:30 p.m.``) outside LaTeX, or the last LaTeX math span
  when that comes later (``$\\frac{1}{2}$`` is one half, never ``2``; ``$2^{10}$`` is 1024,
  never ``10``).
* **Timeouts.** math-verify's own timeout uses ``signal.alarm``, which only works in the main
  thread; we switch it off and bound every call from outside instead (a worker process that
  is killed when it overruns: :mod:`roll_core.rewards.execution`). The warning math-verify
  logs about the disabled timeout is filtered out.
* The reference answer (``row["answer"]`` by default) is parsed the same way (a
  ``\\boxed{}`` inside it is unwrapped; several boxes are one answer, a set: ``\\boxed{2}``
  and ``\\boxed{3}`` need both, in any order, in one box or several) and cached, since
  every prompt is scored ``n`` times.
* **Times and ratios.** math-verify reads ``:`` as a division (``4:30`` = ``2:15``); clock
  times and plain-number ratios are compared by :mod:`roll_core.rewards.math_forms`.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from roll_core.errors import ConfigError
from roll_core.rewards.base import RewardResult, RewardSample
from roll_core.rewards.math_forms import compare_special_forms

__all__ = [
    "MathReward",
    "answers_match",
    "extract_all_boxed",
    "extract_answer",
    "extract_boxed",
    "extract_last_number",
    "reference_answer",
]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number: optional sign (not when it is a binary minus like "7-5"), digits with optional
# thousands commas, an optional decimal part and an optional "/denominator"; then any ":term"
# (a ratio "1:2", a clock time "4:30:15") and, after a time's minutes, an "am"/"p.m.".
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?"
    r"(?::\d+(?:\.\d+)?)*(?:(?<=:\d\d)(?i:\s*[ap]\.?\s*m\b\.?))?"
)


# An inline or display LaTeX math span: $...$, $$...$$, \(...\), \[...\]
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_LATEX_BEFORE = re.compile(r"(?:[{^_]|\\[A-Za-z]+)\s*$")
_LATEX_AFTER = re.compile(r"^\s*[}^_]")


def extract_all_boxed(text: str) -> list[str]:
    """The contents of every complete, non-empty ``\\boxed{...}`` (or ``\\fbox{...}``) in
    ``text``, in order. Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives
    ``\\frac{1}{2}``; a box that never closes (a truncated response) is skipped."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    if content := text[start:i].strip():
                        found.append(content)
                    break
    return found


def extract_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` in ``text`` (see
    :func:`extract_all_boxed`), or None."""
    boxes = extract_all_boxed(text)
    return boxes[-1] if boxes else None


def _last_plain_number(text: str) -> re.Match[str] | None:
    """The last number of ``text`` that is not part of a LaTeX expression: not inside a math
    span (``$\\frac{1}{2}$``), a brace group, an exponent or a subscript (``2^{10}``,
    ``x_1``), nor glued to a command (``\\frac12``)."""
    plain = _MATH_SPAN.sub(lambda m: " " * len(m.group(0)), text)  # keep the positions
    last = None
    for match in _NUMBER.finditer(plain):
        before, after = plain[max(0, match.start() - 64) : match.start()], plain[match.end() :]
        if _LATEX_BEFORE.search(before) or _LATEX_AFTER.match(after):
            continue
        last = match
    return last


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` outside LaTeX expressions, with thousands commas removed
    (``"1,000"`` -> ``"1000"``; ``"$2^{10}$"`` has none)."""
    match = _last_plain_number(text)
    return match.group().replace(",", "") if match else None


def _fallback(text: str) -> str | None:
    """No box, no pattern: the last number outside LaTeX, or the last math span when that
    comes later (``"so $\\frac{1}{2}$"`` -> ``\\frac{1}{2}``, never ``2``)."""
    number = _last_plain_number(text)
    spans = list(_MATH_SPAN.finditer(text))
    if spans and (number is None or spans[-1].start() > number.start()):
        content = next(g for g in spans[-1].groups() if g is not None).strip()
        return content or None
    return number.group().replace(",", "") if number else None


def extract_answer(
    text: str, pattern: re.Pattern[str] | None = None, *, all_boxes: bool = False
) -> str | None:
    """The final answer of a response, or None when it has none (see the module docstring).

    ``all_boxes``: with several boxes, every box's content joined by ``", "`` (compared as a
    set against a reference with several boxes) instead of the last one.
    """
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return None
    boxes = extract_all_boxed(text)
    if boxes:
        return ", ".join(boxes) if all_boxes else boxes[-1]
    if pattern is None:
        return _fallback(text)
    found: str | None = None
    for match in pattern.finditer(text):
        if "answer" in pattern.groupindex:
            found = match.group("answer")
        else:
            found = match.group(1) if pattern.groups else match.group(0)
    if found is None:
        return None
    found = (extract_boxed(found) or found).strip().strip("$").strip()
    return found or None


class _DropDisabledTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _math_verify() -> Any:
    """Import math-verify on first use (0.4 s: SymPy) and silence its timeout warning."""
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropDisabledTimeoutWarning())
    return math_verify


def _parse(text: str) -> list[Any]:
    mv = _math_verify()
    text = text.strip().strip("$").strip()
    parsed = mv.parse("\\boxed{" + text + "}", parsing_timeout=None)
    # Not parsable as math: compare as a string (math-verify does that for str items).
    return list(parsed) if parsed else [text]


def reference_answer(reference: str) -> tuple[str, int]:
    """The answer inside a reference and how many boxes it had: one box is unwrapped,
    several are joined by ``", "`` (math-verify then compares them as a set), none: the
    whole text."""
    boxes = extract_all_boxed(reference)
    return (", ".join(boxes) if boxes else reference), len(boxes)


@functools.lru_cache(maxsize=8192)
def _parse_reference(reference: str) -> tuple[Any, ...]:
    return tuple(_parse(reference_answer(reference)[0]))


def answers_match(reference: str, extracted: str) -> bool:
    """True when ``extracted`` is mathematically the same answer as ``reference``.

    Both are parsed by math-verify (LaTeX or plain expressions) and compared numerically and
    symbolically. Clock times and ratios, which math-verify reads as divisions, are
    compared by :func:`~roll_core.rewards.math_forms.compare_special_forms` instead. No
    timeout of its own: call it under a wall-clock bound.
    """
    special = compare_special_forms(reference_answer(reference)[0], extracted)
    if special is not None:
        return special
    mv = _math_verify()
    gold = list(_parse_reference(reference))
    return bool(mv.verify(gold, _parse(extracted), timeout_seconds=None))


@dataclass(frozen=True)
class MathReward:
    """1.0 when the response's final answer equals the row's reference answer, else 0.0.

    Args:
        answer_pattern: regex for the final answer when there is no ``\\boxed{}`` (named group
            ``answer``, else group 1, else the whole match; ``.`` matches newlines). None: the
            last number in the response.
        answer_key: the row column holding the reference answer.

    ``info``: ``correct`` (bool), ``format_ok`` (an answer was found), ``extracted`` (it, or
    None). A row without a reference answer raises (the router counts it as an error).
    """

    answer_pattern: str | None = None
    answer_key: str = "answer"
    _compiled: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = None
        if self.answer_pattern is not None:
            try:
                compiled = re.compile(self.answer_pattern, re.DOTALL)
            except re.error as err:
                raise ConfigError(
                    f"answer_pattern {self.answer_pattern!r} is not a valid regular "
                    f"expression: {err}.",
                    hint=r"Example: 'answer is\s*(\S+)' (group 1 is the answer).",
                ) from None
        object.__setattr__(self, "_compiled", compiled)

    def warmup(self) -> None:
        """Import math-verify and run one comparison, so the first real call is fast."""
        answers_match("1", "1")

    def __call__(self, sample: RewardSample) -> RewardResult:
        reference = sample.row.get(self.answer_key)
        if reference is None or str(reference).strip() == "":
            raise ValueError(
                f"the row has no reference answer in column {self.answer_key!r} "
                f"(columns: {sorted(sample.row)})"
            )
        several = reference_answer(str(reference))[1] > 1
        extracted = extract_answer(sample.response, self._compiled, all_boxes=several)
        correct = extracted is not None and answers_match(str(reference), extracted)
        info = {"correct": correct, "format_ok": extracted is not None, "extracted": extracted}
        return RewardResult(1.0 if correct else 0.0, info)
