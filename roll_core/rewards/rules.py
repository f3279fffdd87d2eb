"""Rule rewards: instruction-following checks, multiple-choice letters, a repetition penalty.

Each check is a small pure function of the response text; the reward classes at the bottom
apply them to a :class:`RewardSample` (options: :mod:`roll_core.config.reward_options`).

Instruction constraints (a row's ``constraints`` column, or the recipe's fixed list) are
dicts with a ``type``:

=============  =====================================  ========================================
type           fields                                 passes when
=============  =====================================  ========================================
``max_words``  ``value``                              whitespace-separated words <= value
``min_words``  ``value``                              words >= value
``max_chars``  ``value``                              characters <= value
``min_chars``  ``value``                              characters >= value
``keywords``   ``include`` (list), ``exclude``        every ``include`` word appears and no
               (list), ``case_sensitive`` (false)     ``exclude`` word does (whole words)
``json``       (none)                                 the response (or its one fenced block)
                                                      parses as JSON
``language``   ``value`` (``en``, ``fr``, ``de``,     :func:`detect_language` returns it
               ``es``, ``it``, ``pt``, ``ru``,
               ``zh``, ``ja``, ``ko``, ``ar``)
=============  =====================================  ========================================
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roll_core.config.reward_options import ChoiceConfig, InstructionsConfig, RepetitionConfig
from roll_core.errors import DataError
from roll_core.rewards.base import RewardResult, RewardSample

__all__ = [
    "ChoiceReward",
    "InstructionsReward",
    "RepetitionPenalty",
    "check_constraint",
    "check_json",
    "check_keywords",
    "count_words",
    "detect_language",
    "extract_choice",
    "repetition_rate",
    "validate_constraint",
]

# --- instruction following -------------------------------------------------------------------


def count_words(text: str) -> int:
    """Whitespace-separated words: ``count_words("a b  c")`` is 3."""
    return len(text.split())


def check_keywords(
    text: str,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    *,
    case_sensitive: bool = False,
) -> bool:
    """Every ``include`` word or phrase occurs as whole words, and no ``exclude`` one does."""
    flags = 0 if case_sensitive else re.IGNORECASE

    def present(word: str) -> bool:
        return re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", text, flags) is not None

    return all(present(w) for w in include) and not any(present(w) for w in exclude)


_JSON_FENCE = re.compile(r"^\s*```(?:json)?[ \t]*\n(.*)\n```\s*$", re.DOTALL | re.IGNORECASE)


def check_json(text: str) -> bool:
    """The whole response is one JSON value (optionally inside one ```json fence)."""
    match = _JSON_FENCE.match(text)
    body = match.group(1) if match else text
    if not body.strip():
        return False
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


_SCRIPTS: dict[str, tuple[tuple[int, int], ...]] = {
    "ru": ((0x0400, 0x04FF),),
    "ar": ((0x0600, 0x06FF),),
    "ja": ((0x3040, 0x30FF),),  # kana: Japanese even when mixed with kanji
    "ko": ((0xAC00, 0xD7AF), (0x1100, 0x11FF)),
    "zh": ((0x4E00, 0x9FFF),),
}
_STOPWORDS: dict[str, frozenset[str]] = {
    "en": frozenset("the and is are of to in that it with for was on this you not be".split()),
    "fr": frozenset("le la les et est des un une du que qui dans pour pas sur avec ce".split()),
    "de": frozenset("der die das und ist nicht ein eine zu den mit von sich auf für".split()),
    "es": frozenset("el la los las y es de que en un una por con para no se del".split()),
    "it": frozenset("il lo la gli le e è di che un una per con non sono del della".split()),
    "pt": frozenset("o a os as e é de que em um uma para com não do da se".split()),
}


def detect_language(text: str) -> str | None:
    """A small detector: the script for ru/ar/ja/ko/zh, else the language whose common
    words are most frequent among en/fr/de/es/it/pt; None when nothing decides.

    Enough to check "answer in French" for a response of a sentence or more; not a
    general-purpose language identifier (close languages, short texts and mixed text fail).
    """
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return None
    counts = dict.fromkeys(_SCRIPTS, 0)
    for c in letters:
        code = ord(c)
        for lang, ranges in _SCRIPTS.items():
            if any(lo <= code <= hi for lo, hi in ranges):
                counts[lang] += 1
    if counts["ja"]:
        counts["ja"] += counts["zh"]  # kanji in Japanese text
    script, hits = max(counts.items(), key=lambda kv: kv[1])
    if hits * 2 >= len(letters):
        return script
    words = re.findall(r"[^\W\d_]+", text.lower())
    scores = {lang: sum(w in stop for w in words) for lang, stop in _STOPWORDS.items()}
    best = max(scores.values())
    winners = [lang for lang, s in scores.items() if s == best]
    return winners[0] if best > 0 and len(winners) == 1 else None


_LANGS = frozenset(_SCRIPTS) | frozenset(_STOPWORDS)
_TYPES = {
    "max_words": {"value"},
    "min_words": {"value"},
    "max_chars": {"value"},
    "min_chars": {"value"},
    "keywords": {"include", "exclude", "case_sensitive"},
    "json": set(),
    "language": {"value"},
}


def validate_constraint(spec: Any) -> None:
    """Raise ValueError when ``spec`` is not a constraint of the table in the module docstring."""
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ValueError(f"a constraint is a dict with a 'type', got {spec!r}")
    kind = spec["type"]
    if kind not in _TYPES:
        raise ValueError(f"unknown constraint type {kind!r}; valid: {', '.join(_TYPES)}")
    extra = set(spec) - _TYPES[kind] - {"type"}
    if extra:
        raise ValueError(f"constraint {kind!r} takes no {', '.join(sorted(extra))}")
    if "value" in _TYPES[kind] and kind != "language":
        value = spec.get("value")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"constraint {kind!r} needs a non-negative integer 'value'")
    if kind == "language" and spec.get("value") not in _LANGS:
        raise ValueError(f"language must be one of {', '.join(sorted(_LANGS))}")
    if kind == "keywords":
        for key in ("include", "exclude"):
            words = spec.get(key, [])
            if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
                raise ValueError(f"keywords {key!r} must be a list of non-empty strings")


def check_constraint(text: str, spec: Mapping[str, Any]) -> bool:
    """Whether ``text`` satisfies one (valid) constraint."""
    kind = spec["type"]
    if kind == "max_words":
        return count_words(text) <= spec["value"]
    if kind == "min_words":
        return count_words(text) >= spec["value"]
    if kind == "max_chars":
        return len(text) <= spec["value"]
    if kind == "min_chars":
        return len(text) >= spec["value"]
    if kind == "keywords":
        return check_keywords(
            text,
            spec.get("include", ()),
            spec.get("exclude", ()),
            case_sensitive=bool(spec.get("case_sensitive", False)),
        )
    if kind == "json":
        return check_json(text)
    if kind == "language":
        return detect_language(text) == spec["value"]
    raise ValueError(f"unknown constraint type {kind!r}")


def _final_text(text: str) -> str:
    return text.rsplit("</think>", 1)[1].strip() if "</think>" in text else text.strip()


# --- multiple choice -------------------------------------------------------------------------


def extract_choice(text: str, letters: str = "ABCD") -> str | None:
    """The chosen option letter, or None.

    In order: the last ``\\boxed{X}``; the last "answer is X" / "Answer: X" / "answer: (X)";
    else the last standalone letter (``(B)``, ``B.``, ``B)`` or ``B`` alone). Only the text
    after the last ``</think>`` is read.
    """
    text = _final_text(text)
    cls = "[" + re.escape(letters) + "]"
    patterns = (
        r"\\boxed\{\s*\(?(" + cls + r")\)?\s*\}",
        r"(?i:answer)(?:\s+is)?\s*[:\-]?\s*\*{0,2}\s*\(?(" + cls + r")\)?(?![A-Za-z])",
        r"(?<![A-Za-z])\(?(" + cls + r")\)?(?![A-Za-z])",
    )
    for pattern in patterns:
        found = re.findall(pattern, text)
        if found:
            return found[-1]
    return None


# --- repetition -------------------------------------------------------------------------------


def repetition_rate(text: str, n: int = 4) -> float:
    """Fraction of the word n-grams that repeat an earlier one: ``1 - distinct / total``.

    ``"a b a b a b"`` with n=2 has 5 bigrams (ab ba ab ba ab), 2 distinct: 1 - 2/5 = 0.6.
    0.0 when there are no n-grams.
    """
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(Counter(grams)) / len(grams)


# --- the reward classes ------------------------------------------------------------------------


@dataclass(frozen=True)
class InstructionsReward:
    """``instructions``: the share (or all) of the row's and recipe's constraints met.

    ``info``: ``correct`` (all met), ``checks`` (constraint type -> met), ``format_ok``.
    A row without constraints (and none in the recipe) is an error of that sample.
    """

    instructions: InstructionsConfig | None = None

    @property
    def cfg(self) -> InstructionsConfig:
        """The options (defaults when none were given)."""
        return self.instructions or InstructionsConfig()

    def __post_init__(self) -> None:
        for spec in self.cfg.constraints:
            validate_constraint(spec)

    def _constraints(self, row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        found = row.get(self.cfg.constraints_key)
        if isinstance(found, str):
            found = json.loads(found)
        return [*self.cfg.constraints, *(found or [])]

    def check_row(self, row: Mapping[str, Any], where: str = "row") -> None:
        """Raise :class:`DataError` when the row's constraints are malformed or absent."""
        try:
            constraints = self._constraints(row)
            if not isinstance(constraints, list):
                raise ValueError("constraints must be a list")
            for spec in constraints:
                validate_constraint(spec)
        except (ValueError, TypeError) as err:
            raise DataError(
                f"{where}: bad instruction constraint: {err}.",
                hint="See the constraint table in docs/rewards.md.",
            ) from None
        if not constraints:
            raise DataError(
                f"{where} has no constraints in column {self.cfg.constraints_key!r} and the "
                "recipe gives none.",
                hint="Add constraints to the row or to the instructions reward.",
            )

    def __call__(self, sample: RewardSample) -> RewardResult:
        constraints = self._constraints(sample.row)
        if not constraints:
            raise ValueError(f"the row has no constraints ({self.cfg.constraints_key!r})")
        text = _final_text(sample.response)
        results = []
        for spec in constraints:
            validate_constraint(spec)
            results.append(check_constraint(text, spec))
        met = sum(results)
        score = float(met == len(results)) if self.cfg.score == "all" else met / len(results)
        checks = {
            f"{i}:{spec['type']}": ok
            for i, (spec, ok) in enumerate(zip(constraints, results, strict=True))
        }
        return RewardResult(score, {"correct": met == len(results), "checks": checks})


@dataclass(frozen=True)
class ChoiceReward:
    """``choice``: 1.0 when the extracted letter equals the row's answer letter.

    ``info``: ``correct``, ``format_ok`` (a letter was found), ``extracted``.
    """

    answer_key: str = "answer"
    choice: ChoiceConfig | None = None

    def __call__(self, sample: RewardSample) -> RewardResult:
        letters = (self.choice or ChoiceConfig()).letters
        reference = str(sample.row.get(self.answer_key, "")).strip().strip("()").upper()
        if reference not in letters or len(reference) != 1:
            raise ValueError(
                f"the row's {self.answer_key!r} is {sample.row.get(self.answer_key)!r}, not one "
                f"of the letters {letters}"
            )
        extracted = extract_choice(sample.response, letters)
        correct = extracted == reference
        info = {"correct": correct, "format_ok": extracted is not None, "extracted": extracted}
        return RewardResult(1.0 if correct else 0.0, info)


@dataclass(frozen=True)
class RepetitionPenalty:
    """``repetition``: ``-repetition_rate(response, ngram)`` (0 for short responses).

    Use it with a weight in a domain's sum: ``{name: repetition, weight: 0.5}``.
    """

    repetition: RepetitionConfig | None = None

    def __call__(self, sample: RewardSample) -> RewardResult:
        cfg = self.repetition or RepetitionConfig()
        if count_words(sample.response) < cfg.min_tokens:
            return RewardResult(0.0, {"repetition": 0.0})
        rate = repetition_rate(sample.response, cfg.ngram)
        return RewardResult(-rate, {"repetition": rate})
