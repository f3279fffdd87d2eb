"""Rule rewards: each check on hand-made texts with hand-computed results."""

from __future__ import annotations

import pytest

from roll_core.config.reward_options import InstructionsConfig, RepetitionConfig
from roll_core.errors import DataError
from roll_core.rewards.base import RewardSample
from roll_core.rewards.rules import (
    ChoiceReward,
    InstructionsReward,
    RepetitionPenalty,
    check_constraint,
    check_json,
    check_keywords,
    count_words,
    detect_language,
    extract_choice,
    repetition_rate,
    validate_constraint,
)


def test_length_checks() -> None:
    text = "one two  three\nfour"  # 4 words, 19 characters
    assert count_words(text) == 4
    assert check_constraint(text, {"type": "max_words", "value": 4})
    assert not check_constraint(text, {"type": "max_words", "value": 3})
    assert check_constraint(text, {"type": "min_words", "value": 4})
    assert check_constraint(text, {"type": "max_chars", "value": 19})
    assert not check_constraint(text, {"type": "max_chars", "value": 18})
    assert not check_constraint(text, {"type": "min_chars", "value": 20})


def test_keywords_are_whole_words_case_insensitive_by_default() -> None:
    text = "The Cat sat on the mat."
    assert check_keywords(text, ["cat", "mat"])
    assert not check_keywords(text, ["at"])  # not a whole word
    assert not check_keywords(text, ["cat"], ["MAT"])
    assert not check_keywords(text, ["cat"], case_sensitive=True)
    assert check_keywords(text, ["sat on"])  # phrases work


def test_json_format() -> None:
    assert check_json('{"a": [1, 2]}')
    assert check_json('```json\n{"a": 1}\n```')
    assert check_json("42")
    assert not check_json('{"a": 1} trailing')
    assert not check_json('Here it is: {"a": 1}')
    assert not check_json("   ")


@pytest.mark.parametrize(
    ("text", "lang"),
    [
        ("The cat is on the mat and it is happy.", "en"),
        ("Le chat est sur la table et il dort dans la maison.", "fr"),
        ("Der Hund ist nicht in dem Haus und die Katze schläft.", "de"),
        ("El perro está en la casa y la gata duerme con los niños.", "es"),
        ("Кошка сидит на ковре.", "ru"),
        ("猫はマットの上に座っています。", "ja"),
        ("猫坐在垫子上。", "zh"),
        ("고양이가 매트 위에 앉아 있다.", "ko"),
        ("12345 !!!", None),
    ],
)
def test_detect_language(text: str, lang: str | None) -> None:
    assert detect_language(text) == lang


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("The answer is (B).", "B"),
        ("Answer: C", "C"),
        ("I think it's \\boxed{D}", "D"),
        ("<think>maybe A</think> **Answer:** b) no, (C)", "C"),
        ("Between A and B, I pick B.", "B"),
        ("none of these", None),
        ("The answer is E.", None),  # not one of ABCD
    ],
)
def test_extract_choice(text: str, letter: str | None) -> None:
    assert extract_choice(text, "ABCD") == letter


def test_repetition_rate_by_hand() -> None:
    # bigrams of "a b a b a b": ab ba ab ba ab -> 5 total, 2 distinct -> 1 - 2/5
    assert repetition_rate("a b a b a b", 2) == pytest.approx(0.6)
    assert repetition_rate("a b c d e", 2) == 0.0
    assert repetition_rate("a", 2) == 0.0


def test_instructions_reward_fraction_and_all() -> None:
    row = {
        "constraints": [
            {"type": "max_words", "value": 5},
            {"type": "keywords", "include": ["paris"]},
            {"type": "language", "value": "en"},
        ]
    }
    text = "<think>long musing here</think>Paris is the capital of France."  # 6 words
    frac = InstructionsReward(InstructionsConfig(score="fraction"))
    result = frac(RewardSample("p", text, row))
    assert result.score == pytest.approx(2 / 3)  # too long, has paris, English
    assert result.info["correct"] is False
    strict = InstructionsReward(InstructionsConfig(score="all"))
    assert strict(RewardSample("p", text, row)).score == 0.0
    fixed = InstructionsReward(InstructionsConfig(constraints=[{"type": "json"}]))
    assert fixed(RewardSample("p", '{"ok": true}', {})).score == 1.0


def test_malformed_constraints_are_data_errors() -> None:
    reward = InstructionsReward()
    with pytest.raises(DataError, match="unknown constraint type 'shout'"):
        reward.check_row({"constraints": [{"type": "shout"}]}, "row 2")
    with pytest.raises(DataError, match="non-negative integer"):
        reward.check_row({"constraints": [{"type": "max_words", "value": "ten"}]})
    with pytest.raises(DataError, match="has no constraints"):
        reward.check_row({})
    with pytest.raises(ValueError, match="language must be one of"):
        validate_constraint({"type": "language", "value": "klingon"})


def test_choice_reward() -> None:
    reward = ChoiceReward()
    row = {"answer": "(c)"}
    assert reward(RewardSample("p", "The answer is C", row)).score == 1.0
    wrong = reward(RewardSample("p", "The answer is A", row))
    assert wrong.score == 0.0 and wrong.info["extracted"] == "A"
    with pytest.raises(ValueError, match="not one of the letters"):
        reward(RewardSample("p", "A", {"answer": "42"}))


def test_repetition_penalty() -> None:
    penalty = RepetitionPenalty(RepetitionConfig(ngram=2, min_tokens=4))
    assert penalty(RewardSample("p", "a b a b a b", {})).score == pytest.approx(-0.6)
    assert penalty(RewardSample("p", "a b a", {})).score == 0.0  # shorter than min_tokens
