"""Answers math-verify reads wrongly: clock times and ratios (``a:b``, ``a:b:c``).

math-verify (latex2sympy) reads every ``:`` as a division: ``4:30`` is 4/30 = 2/15, so a gold
``4:30`` accepts ``\\boxed{2:15}``, ``12:00`` is 12/0 (``zoo``), ``1:2:3`` is (1/2)/3 = 1/6
(accepting ``1/6`` and ``1:6:1``, refusing ``2:4:6``), and ``\\text{4:30 p.m.}`` is one
opaque symbol that equals nothing but itself. This module decides such pairs itself; every
other pair goes to math-verify unchanged.

* **A clock time** is ``H:MM`` or ``H:MM:SS`` (two-digit minutes and seconds, 0-59; hours
  0-23, or 1-12 with ``am``/``pm``), with an optional ``a.m.``, ``pm``, ``\\text{ p.m.}``,
  ``noon`` or ``midnight`` in any case and spacing, inside ``\\text{}``/``\\mathrm{}`` or
  not. A time with no am/pm and an hour of 1-12 may be either half of the day; the answer
  must name a time the reference allows: a reference ``4:30`` takes ``4:30``, ``4:30 pm`` and ``16:30``; a reference
  ``4:30 p.m.`` takes ``4:30 pm`` and ``16:30`` but not a bare ``4:30``. A time is never a
  number or a ratio (``2:15`` against ``4:30`` scores 0). So a ratio whose second term has
  two digits (``3:10``) is read as a time: it matches only the same time.
* **A ratio** is two or more plain numbers (integers, decimals, ``a/b``) joined by ``:``
  (or ``\\colon``). Two ratios match when one is a non-zero multiple of the other
  (``1:2`` = ``2:4`` = ``0.5:1``); ``0:0`` matches only ``0:0``. A two-term reference ratio
  may also be answered by its value (``1:2`` and ``0.5``, through math-verify; not when its
  second term is 0); a ratio of three or more terms only by a ratio.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["compare_special_forms", "parse_clock_time", "parse_ratio"]

_TEXT_COMMAND = re.compile(
    r"\\(?:text|textrm|textnormal|textup|mathrm|mbox|operatorname)\s*\{([^{}]*)\}"
)
_LATEX_SPACE = re.compile(r"\\[,;:!> ]|~")
_TIME = re.compile(
    r"(\d{1,2}):([0-5]\d)(?::([0-5]\d))?(?:\s*(?:([ap])\.?\s*m\.?|(noon)|(midnight)))?",
    re.IGNORECASE,
)
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+(?:\.\d+)?)?")


def _plain(text: str) -> str:
    """``text`` without ``$``, LaTeX spaces and text wrappers, whitespace collapsed."""
    text = text.strip().strip("$")
    previous = None
    while previous != text:
        previous, text = text, _TEXT_COMMAND.sub(r" \1 ", text)
    text = _LATEX_SPACE.sub(" ", text.replace("{:}", ":").replace("\\colon", ":"))
    return " ".join(text.split())


def parse_clock_time(text: str) -> frozenset[int] | None:
    """The seconds after midnight ``text`` may mean as a clock time (two when it has no
    am/pm and an hour of 1-12), or None when it is not a clock time."""
    found = _TIME.fullmatch(_plain(text))
    if found is None:
        return None
    hour, minute, second, half, noon, midnight = found.groups()
    h, rest = int(hour), int(minute) * 60 + int(second or 0)
    if noon or midnight:  # 12:00 noon, 12:00 midnight
        half = "p" if noon else "a"
    if half is not None:
        if not 1 <= h <= 12:
            return None
        return frozenset({(h % 12 + (12 if half.lower() == "p" else 0)) * 3600 + rest})
    if h > 23:
        return None
    if 1 <= h <= 12:
        return frozenset({(h % 12) * 3600 + rest, (h % 12 + 12) * 3600 + rest})
    return frozenset({h * 3600 + rest})


def parse_ratio(text: str) -> tuple[Fraction, ...] | None:
    """The terms of ``text`` as a ratio of plain numbers (``1:2``, ``3 : 4 : 5``), or None."""
    terms = [term.strip() for term in _plain(text).split(":")]
    if len(terms) < 2 or not all(_PLAIN_NUMBER.fullmatch(term) for term in terms):
        return None
    try:
        return tuple(Fraction(term) for term in terms)
    except ZeroDivisionError:  # a term like 1/0
        return None


def _proportional(gold: tuple[Fraction, ...], answer: tuple[Fraction, ...]) -> bool:
    if len(gold) != len(answer):
        return False
    pivot = next((i for i, term in enumerate(gold) if term != 0), None)
    if pivot is None:  # 0:0 is only 0:0
        return all(term == 0 for term in answer)
    if answer[pivot] == 0:
        return False
    scale = answer[pivot] / gold[pivot]
    return all(a == scale * g for g, a in zip(gold, answer, strict=True))


def compare_special_forms(reference: str, answer: str) -> bool | None:
    """True or False when ``reference`` or ``answer`` is a clock time or a ratio that
    math-verify would misread (see the module docstring); None: let math-verify decide."""
    gold_time, answer_time = parse_clock_time(reference), parse_clock_time(answer)
    if gold_time is not None:
        return answer_time is not None and answer_time <= gold_time
    if answer_time is not None:
        return False
    gold_ratio, answer_ratio = parse_ratio(reference), parse_ratio(answer)
    if gold_ratio is not None and answer_ratio is not None:
        return _proportional(gold_ratio, answer_ratio)
    if gold_ratio is not None:  # the answer is not a plain ratio: its value, at most
        return None if len(gold_ratio) == 2 and gold_ratio[1] != 0 else False
    if answer_ratio is not None:
        return None if len(answer_ratio) == 2 and answer_ratio[1] != 0 else False
    return None
