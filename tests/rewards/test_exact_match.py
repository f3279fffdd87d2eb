"""`exact_match`: the response equals the row's answer after the chosen normalisations."""

from __future__ import annotations

import pytest

from roll_core.config.reward import DomainRewardConfig
from roll_core.config.reward_options import ExactMatchConfig
from roll_core.rewards.base import RewardSample
from roll_core.rewards.exact_match import ExactMatchReward, normalize
from roll_core.rewards.registry import build_domain_reward


def score(response: str, answer: object, **options: bool) -> float:
    reward = ExactMatchReward(exact_match=ExactMatchConfig(**options) if options else None)
    return reward(RewardSample(prompt="q", response=response, row={"answer": answer})).score


def test_default_strips_only() -> None:
    assert score(" 160\n", "160") == 1.0  # strip is on by default
    assert score("160.", "160") == 0.0  # no number extraction: stricter than `math`
    assert score("The answer is 160", "160") == 0.0
    assert score("Paris", "paris") == 0.0  # case kept by default
    assert score("160", 160) == 1.0  # a non-string answer compares as its str()


def test_each_normalisation() -> None:
    assert score(" 160 ", "160", strip=False) == 0.0
    assert score("Paris", "paris", ignore_case=True) == 1.0
    assert score("New  York\tCity", "New York City") == 0.0
    assert score("New  York\tCity", "New York City", collapse_whitespace=True) == 1.0
    cfg = ExactMatchConfig(ignore_case=True, collapse_whitespace=True)
    assert normalize("  A\n\nB  ", cfg) == "a b"


def test_info_and_missing_answer() -> None:
    result = ExactMatchReward()(RewardSample(prompt="q", response="7", row={"answer": "7"}))
    assert result.info == {"correct": True, "format_ok": True}
    with pytest.raises(ValueError, match="'answer'"):
        ExactMatchReward()(RewardSample(prompt="q", response="7", row={}))


def test_built_from_a_recipe_section() -> None:
    spec = DomainRewardConfig.model_validate(
        {"rewards": [{"name": "exact_match", "exact_match": {"ignore_case": True}}]}
    )
    fn = build_domain_reward(spec)
    sample = RewardSample(prompt="q", response="YES", row={"answer": "yes"})
    assert fn(sample).score == 1.0 and fn(sample).info["correct"] is True
    with pytest.raises(ValueError, match="does not apply"):
        DomainRewardConfig.model_validate(
            {"rewards": [{"name": "math", "exact_match": {"ignore_case": True}}]}
        )
