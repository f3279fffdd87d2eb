"""The math rule reward: answer extraction and math-verify equivalence."""

from __future__ import annotations

import re

import pytest

from roll_core.errors import ConfigError
from roll_core.rewards import (
    MathReward,
    RewardSample,
    answers_match,
    extract_answer,
    extract_boxed,
    extract_last_number,
)


def sample(response: str, answer: str | None = "68") -> RewardSample:
    row = {"prompt": "q", "domain": "math"}
    if answer is not None:
        row["answer"] = answer
    return RewardSample(prompt="q", response=response, row=row)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{68}.", "68"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces are matched
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last box wins
        (r"\boxed{3} and a truncated \boxed{\frac{1}{", "3"),  # an unclosed box is skipped
        (r"\fbox{7}", "7"),
        ("no box here", None),
        (r"\boxed{ }", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("68", "68"),
        ("The answer is 68.", "68"),  # the sentence's full stop is not a decimal point
        ("84 + 76 = 160", "160"),
        ("x = -5", "-5"),
        ("7-5", "5"),  # a binary minus is not a sign
        ("it costs 1,000 dollars", "1000"),
        ("half: 1/2", "1/2"),
        ("pi is about 3.14", "3.14"),
        ("mix them 1:2.", "1:2"),  # a ratio, not its last term
        ("we meet at 4:30 p.m. sharp", "4:30 p.m."),
        ("at 4:30 PM.", "4:30 PM."),
        ("at 4:30 a meeting starts", "4:30"),
        ("it lasts 1:05:30", "1:05:30"),
        ("no digits", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


def test_extract_answer_order_and_thinking() -> None:
    # a box beats the last number
    assert extract_answer(r"\boxed{68}, not 67") == "68"
    # only the text after </think> is graded
    assert extract_answer("<think>maybe 12</think> The answer is 13") == "13"
    # thinking never finished: no final answer
    assert extract_answer("<think>maybe 12") is None
    # a configured pattern: group 1, named group, whole match; the last match wins
    assert extract_answer("Answer: 4. Answer: 5.", re.compile(r"Answer: (\d+)")) == "5"
    assert (
        extract_answer("<answer>$7$</answer>", re.compile(r"<answer>(?P<answer>.*?)</answer>"))
        == "7"
    )
    assert extract_answer("x=9", re.compile(r"\d+")) == "9"
    assert extract_answer("<answer>\\boxed{8}</answer>", re.compile("<answer>(.*)</answer>")) == "8"
    assert extract_answer("68", re.compile(r"Answer: (\d+)")) is None  # pattern, no match


@pytest.mark.parametrize(
    ("reference", "answer"),
    [
        ("0.5", "1/2"),
        ("1/2", "0.5"),
        ("0.5", r"\frac{1}{2}"),
        (r"\frac{1}{2}", "1/2"),
        (r"\frac{1}{2}", r"\frac12"),
        ("1000", "1,000"),
        ("3", "3.0"),
        ("-5", "-5"),
        (r"The area is \boxed{68}.", "68"),  # a reference with a box is unwrapped
        (r"x^2+1", r"1+x^2"),
    ],
)
def test_equivalent_forms(reference: str, answer: str) -> None:
    assert answers_match(reference, answer)


@pytest.mark.parametrize(
    ("reference", "answer"), [("68", "67"), ("0.5", "1/3"), ("1/2", "2"), ("x+1", "x-1")]
)
def test_wrong_answers(reference: str, answer: str) -> None:
    assert not answers_match(reference, answer)


def test_math_reward_scores_and_info() -> None:
    reward = MathReward()
    right = reward(sample("The answer is 68."))
    assert right.score == 1.0
    assert right.info == {"correct": True, "format_ok": True, "extracted": "68"}
    wrong = reward(sample("68 is wrong, it is 69"))  # the last number is graded
    assert (wrong.score, wrong.info["extracted"], wrong.info["correct"]) == (0.0, "69", False)
    boxed = reward(sample(r"Half of it: \boxed{\frac{1}{2}}", answer="0.5"))
    assert boxed.score == 1.0
    nothing = reward(sample("I do not know"))
    assert nothing.score == 0.0
    assert nothing.info == {"correct": False, "format_ok": False, "extracted": None}


def test_math_reward_answer_pattern_and_key() -> None:
    reward = MathReward(answer_pattern=r"answer is (\S+?)\.?$", answer_key="solution")
    s = RewardSample("q", "42 steps later the answer is 17.", {"solution": "17"})
    assert reward(s).score == 1.0
    assert reward(RewardSample("q", "just 17", {"solution": "17"})).info["extracted"] is None


def test_math_reward_without_reference_raises() -> None:
    with pytest.raises(ValueError, match="no reference answer in column 'answer'"):
        MathReward()(sample("68", answer=None))


def test_bad_answer_pattern_is_config_error() -> None:
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        MathReward(answer_pattern="(unclosed")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\frac{1}{2}$", r"\frac{1}{2}"),  # the math span, never its last digit 2
        (r"so $2^{10}$", "2^{10}"),  # never the exponent 10
        (r"\(7\)", "7"),
        (r"$$x = 4$$ hence 5", "5"),  # a plain number after the span wins
        ("2^{10}", None),  # bare LaTeX: every number is inside an expression
        (r"\frac12", None),
        ("x_1 = 5", "5"),  # the subscript 1 is skipped, 5 is plain
    ],
)
def test_the_fallback_does_not_take_a_number_inside_latex(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "reference", "score"),
    [
        (r"so $\frac{1}{2}$", "2", 0.0),  # was 1.0: the last number of \frac{1}{2} is 2
        (r"so $\frac{1}{2}$", "0.5", 1.0),
        (r"so $2^{10}$", "10", 0.0),  # was 1.0
        (r"so $2^{10}$", "1024", 1.0),  # 2^10 = 1024
    ],
)
def test_latex_answers_are_graded_as_expressions(
    response: str, reference: str, score: float
) -> None:
    assert MathReward()(sample(response, answer=reference)).score == score


@pytest.mark.parametrize(
    ("response", "score"),
    [
        (r"\boxed{2} and \boxed{3}", 1.0),  # both, as in the reference
        (r"\boxed{3}, \boxed{2}", 1.0),  # a set: order does not matter
        (r"\boxed{2, 3}", 1.0),  # one box holding both
        (r"\boxed{3}", 0.0),  # partial: was 1.0 (the reference was cut to its last box)
        (r"\boxed{2} \boxed{3} \boxed{4}", 0.0),  # hedging with an extra answer
    ],
)
def test_a_reference_with_several_boxes_is_one_set_answer(response: str, score: float) -> None:
    result = MathReward()(sample(response, answer=r"$x = \boxed{2}$ or $x = \boxed{3}$"))
    assert result.score == score, result.info


def test_a_single_box_reference_still_takes_the_last_box_of_the_response() -> None:
    assert MathReward()(sample(r"draft \boxed{1}, final \boxed{2}", answer="2")).score == 1.0


# math-verify reads ":" as a division (4:30 = 2/15, 12:00 = 12/0, 1:2:3 = 1/6): clock times
# and ratios are compared by roll_core.rewards.math_forms. (reference, boxed answer, score)
@pytest.mark.parametrize(
    ("reference", "answer", "score"),
    [
        # clock times: never a ratio
        ("4:30", "2:15", 0.0),
        ("4:30", "4:30", 1.0),
        ("4:30", "8:60", 0.0),  # not a time (60 minutes); the same ratio as 4:30
        ("2/15", "4:30", 0.0),  # a time is not a number
        (r"\text{4:30 p.m.}", r"4:30 \text{ p.m.}", 1.0),
        (r"\text{4:30 p.m.}", r"\text{4:30 PM}", 1.0),
        ("4:30 p.m.", "16:30", 1.0),
        ("4:30 p.m.", "4:30", 0.0),  # the reference says pm; a bare 4:30 may be am
        ("4:30 p.m.", "4:30 a.m.", 0.0),
        ("4:30", "4:30 pm", 1.0),  # a bare reference allows either half of the day
        ("4:30", "16:30", 1.0),
        ("16:30", "4:30", 0.0),
        ("12:00", "12:00", 1.0),  # 12/0 for math-verify: equal to every x:0
        ("12:00", "1:0", 0.0),
        ("12:00", r"12:00 \text{ noon}", 1.0),
        ("12:00 a.m.", "0:00", 1.0),
        ("12:00 a.m.", r"12:00 \text{ noon}", 0.0),
        ("4:30:15", "4:30:15", 1.0),
        ("4:30:15", "4:30", 0.0),
        ("4:30:15", "2:15:30", 0.0),  # (4/30)/15 = (2/15)/15 for math-verify
        ("4:30:00", "4:30", 1.0),
        # ratios: proportional, same number of terms
        ("1:2", "1:2", 1.0),
        ("1:2", "2:4", 1.0),
        ("1:2", "0.5", 1.0),  # a two-term ratio may be answered by its value
        ("1:2", "2:1", 0.0),
        ("1:2", "0:0", 0.0),
        ("0:0", "0:0", 1.0),
        ("3:0", "1:0", 1.0),
        ("3:0", r"\infty", 0.0),
        ("1:2:3", "2:4:6", 1.0),
        ("1:2:3", r"1 \colon 2 \colon 3", 1.0),
        ("1:2:3", "1/6", 0.0),  # (1/2)/3 for math-verify
        ("1:2:3", "1:6:1", 0.0),
        ("1:2:3", "1:2", 0.0),
    ],
)
def test_clock_times_and_ratios(reference: str, answer: str, score: float) -> None:
    result = MathReward()(sample(rf"So the answer is \boxed{{{answer}}}.", answer=reference))
    assert result.score == score, result.info


@pytest.mark.parametrize(
    ("reference", "response", "score"),
    [
        ("4:30 p.m.", "The train leaves at 4:30 p.m.", 1.0),
        ("4:30 p.m.", "The train leaves at 4:30.", 0.0),  # am or pm?
        ("16:30", "The train leaves at 4:30 PM", 1.0),
        ("1:2", "Mix water and syrup 2:4.", 1.0),
        ("4:30", "It is 2:15.", 0.0),
    ],
)
def test_times_and_ratios_without_a_box(reference: str, response: str, score: float) -> None:
    assert MathReward()(sample(response, answer=reference)).score == score
