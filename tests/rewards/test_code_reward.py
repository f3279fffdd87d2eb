"""The code reward: program extraction, test parsing, the adaptive timeout, scoring."""

from __future__ import annotations

import pickle

import pytest

from roll_core.config.reward_options import AdaptiveTimeoutConfig, CodeRewardConfig
from roll_core.errors import DataError
from roll_core.rewards.base import RewardSample
from roll_core.rewards.code import (
    AdaptiveTimeout,
    CodeReward,
    extract_code,
    parse_tests,
    percentiles,
)
from roll_core.rewards.sandbox import TestCase


def test_extract_code_takes_the_last_python_block_after_thinking() -> None:
    text = (
        "<think>```python\nprint('draft')\n```</think>"
        "Here:\n```python\nprint(1)\n```\nand a shell line\n```bash\nls\n```\n"
    )
    assert extract_code(text) == "print(1)\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```py\n\n```") is None
    assert extract_code("no code here") is None
    assert extract_code("<think>```python\nprint(1)\n```") is None  # never closed: no answer


def test_parse_tests_accepts_the_three_forms() -> None:
    asserts = parse_tests(["assert f(1) == 2", "assert f(2) == 3"])
    assert asserts == (
        TestCase("assert", test="assert f(1) == 2"),
        TestCase("assert", test="assert f(2) == 3"),
    )
    pairs = parse_tests('[{"input": "1\\n", "output": "2\\n"}]')
    assert pairs == (TestCase("stdio", stdin="1\n", stdout="2\n"),)
    apps = parse_tests({"inputs": ["1\n", "2\n"], "outputs": ["2\n", "3\n"]})
    assert [c.stdout for c in apps] == ["2\n", "3\n"]
    contests = parse_tests({"input": ["1\n"], "output": ["2\n"]})
    assert contests == (TestCase("stdio", stdin="1\n", stdout="2\n"),)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "expected a non-empty list"),
        ([], "expected a non-empty list"),
        ("not json", "not JSON"),
        (["assert f(1) =="], "test 0 is not valid Python"),
        ([{"input": "1"}], "test 0 is not a test"),
        ([{"input": 1, "output": "2"}], "must be strings"),
        ({"inputs": ["1"], "outputs": []}, "same length"),
        ({"inputs": ["1"], "outputs": ["2"], "fn_name": "f"}, "call-based"),
        ([42], "test 0 is not a test"),
    ],
)
def test_malformed_tests_are_data_errors(value: object, message: str) -> None:
    with pytest.raises(DataError, match=message):
        parse_tests(value, where="row 7")


def test_check_row_names_the_missing_column() -> None:
    with pytest.raises(DataError, match="has no 'tests' column"):
        CodeReward().check_row({"prompt": "p"}, "row 3")
    CodeReward().check_row({"tests": ["assert True"]})


def test_adaptive_timeout_follows_rollpacker() -> None:
    cfg = AdaptiveTimeoutConfig(min_s=1.0, max_s=10.0, lam=3.0, scope="problem")
    t = AdaptiveTimeout(cfg)
    assert t.timeout("p") == 10.0  # no passing run yet: T_max
    t.observe("p", 0.1)
    assert t.timeout("p") == 1.0  # max(1, 3 * 0.1) = 1
    t.observe("p", 0.5)
    assert t.timeout("p") == 1.5  # the slowest passing run: 3 * 0.5
    t.observe("p", 0.2)
    assert t.timeout("p") == 1.5  # a faster run does not lower the anchor
    t.observe("p", 5.0)
    assert t.timeout("p") == 10.0  # capped: min(15, 10)
    assert t.timeout("q") == 10.0  # another problem has its own anchor
    glob = AdaptiveTimeout(AdaptiveTimeoutConfig(min_s=0.5, max_s=4.0, lam=2.0, scope="global"))
    glob.observe("p", 0.4)
    assert glob.timeout("q") == 0.8  # 2 * 0.4
    fixed = AdaptiveTimeout(AdaptiveTimeoutConfig(adaptive=False, max_s=4.0))
    fixed.observe("p", 0.1)
    assert fixed.timeout("p") == 4.0


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentiles(values) == {50: 5.0, 90: 9.0, 99: 10.0}
    assert percentiles([]) == {}


def test_scores_all_pass_and_pass_fraction() -> None:
    row = {"tests": [{"input": f"{i}\n", "output": f"{i * 2}\n"} for i in range(4)]}
    half = "```python\nn = int(input())\nprint(n * 2 if n < 2 else 0)\n```"
    fraction = CodeReward(CodeRewardConfig(score="pass_fraction"))
    result = fraction(RewardSample("p", half, row))
    assert result.score == 0.5 and result.info["passed"] == 2 and result.info["cases"] == 4
    strict = CodeReward(CodeRewardConfig(score="all_pass"))
    result = strict(RewardSample("p", half, row))
    assert result.score == 0.0
    assert result.info["statuses"] == ["pass", "pass", "fail", "not_run"]  # stops at a failure
    assert strict(RewardSample("p", "no code", row)).info["format_ok"] is False
    metrics = strict.metrics()
    assert metrics["code/pass_rate"] == 0.0 and metrics["code/no_code"] == 1.0
    assert metrics["code/executions"] == 3.0 and metrics["code/case_pass_rate"] == 2 / 3
    assert set(metrics) >= {"code/exec_ms_p50", "code/exec_ms_p90", "code/exec_ms_p99"}
    assert strict.metrics() == {}  # the window was reset


def test_passing_runs_set_the_anchor() -> None:
    reward = CodeReward(
        CodeRewardConfig.model_validate({"timeout": {"min_s": 2.0, "max_s": 8.0, "lam": 3.0}})
    )
    tests = ["assert double(2) == 4"]
    row = {"tests": tests}
    sample = RewardSample("p", "```python\ndef double(x):\n    return 2 * x\n```", row)
    assert reward(sample).info["timeout_s"] == 8.0  # first run: T_max
    anchor = reward.timeouts.anchor(next(iter(reward.timeouts._anchors)))
    assert anchor is not None and 0 < anchor < 2.0
    assert reward(sample).info["timeout_s"] == max(2.0, min(3.0 * anchor, 8.0))


def test_pickles_without_its_runtime_state() -> None:
    reward = CodeReward(CodeRewardConfig(score="pass_fraction"))
    reward.warmup()
    copy = pickle.loads(pickle.dumps(reward))
    assert copy.cfg.score == "pass_fraction" and copy._state == {}
