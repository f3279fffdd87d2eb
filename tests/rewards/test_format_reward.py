"""The format reward and weighted sums of rewards."""

from __future__ import annotations

import pytest

from roll_core.errors import ConfigError
from roll_core.rewards import FormatReward, MathReward, RewardSample, WeightedSum


def s(response: str, answer: str = "5") -> RewardSample:
    return RewardSample("q", response, {"answer": answer, "domain": "math"})


@pytest.mark.parametrize(
    ("response", "ok"),
    [
        ("<think>2+3</think><answer>5</answer>", True),
        ("  <think>a\nb</think>\n<answer>\n5\n</answer>\n", True),  # whitespace, newlines
        ("<answer>5</answer>", False),  # no think block
        ("<think>x</think>", False),  # no answer block
        ("<think>x</think><answer>5</answer> trailing", False),  # text after the answer
        ("<think>a</think><think>b</think><answer>5</answer>", False),  # two think blocks
        ("<think><think>a</think></think><answer>5</answer>", False),  # nested tags
    ],
)
def test_default_format(response: str, ok: bool) -> None:
    result = FormatReward()(s(response))
    assert result.score == (1.0 if ok else 0.0)
    assert result.info == {"format_ok": ok}


def test_custom_pattern_matches_whole_response() -> None:
    reward = FormatReward(pattern=r".*The answer is \d+\.")
    assert reward(s("Adding: The answer is 5.")).score == 1.0
    assert reward(s("The answer is 5. Bye")).score == 0.0  # must match the whole response


def test_bad_pattern() -> None:
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        FormatReward(pattern="[a-")


def test_weighted_sum() -> None:
    both = WeightedSum((("math", 1.0, MathReward()), ("format", 0.5, FormatReward())))
    # right answer, right format: 1.0 * 1 + 0.5 * 1 = 1.5
    r = both(s(r"<think>2+3</think><answer>\boxed{5}</answer>"))
    assert r.score == pytest.approx(1.5)
    assert r.info["math/score"] == 1.0 and r.info["format/score"] == 1.0
    assert r.info["correct"] is True
    # right answer, no format: 1.0 * 1 + 0.5 * 0 = 1.0
    assert both(s("5")).score == pytest.approx(1.0)
    # wrong answer, right format: 1.0 * 0 + 0.5 * 1 = 0.5
    assert both(s("<think>hm</think><answer>6</answer>")).score == pytest.approx(0.5)
    # a negative weight penalises: 1.0 * 1 - 0.25 * 1 = 0.75
    penalty = WeightedSum((("math", 1.0, MathReward()), ("format", -0.25, FormatReward())))
    assert penalty(s("<think>a</think><answer>5</answer>")).score == pytest.approx(0.75)
