"""roll eval's settings checks, metrics and output paths (no model loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.errors import UsageError
from roll_core.evaluation import EvalSettings, ResolvedModel, check_settings
from roll_core.evaluation.evaluate import default_out_path, summarize, summary_path
from roll_core.rollout.one_turn import Prompt, Sample
from roll_core.runs import Run


def sample(group: int, length: int, correct: bool | None, reward: float, finish="stop") -> Sample:
    info = {} if correct is None else {"correct": correct}
    s = Sample(0, group, Prompt(group, [1], {}), [7] * length, [0.0] * length, finish, 0)
    s.reward, s.reward_info = reward, info
    return s


def test_summarize_hand_computed() -> None:
    # prompt 0: 1 of 4 correct; prompt 1: 3 of 4 correct (n = 4)
    samples = [
        sample(0, 2, True, 1.0),
        sample(0, 4, False, 0.0),
        sample(0, 4, False, 0.0, finish="length"),
        sample(0, 6, False, 0.0),
        sample(1, 2, True, 1.0),
        sample(1, 2, True, 1.0),
        sample(1, 4, True, 1.0, finish="length"),
        sample(1, 8, False, 0.0),
    ]
    m = summarize(samples, n=4)
    assert m["prompts"] == 2 and m["samples"] == 8
    assert m["accuracy"] == pytest.approx(4 / 8)
    assert m["pass@1"] == pytest.approx(0.5)  # (1/4 + 3/4) / 2
    assert m["pass@2"] == pytest.approx((0.5 + 1.0) / 2)  # 1-C(3,2)/C(4,2) = .5; 3 of 4: 1
    assert m["pass@4"] == pytest.approx(1.0)
    assert m["response_length_mean"] == pytest.approx(32 / 8)  # 2+4+4+6+2+2+4+8
    assert m["truncated_fraction"] == pytest.approx(2 / 8)
    assert m["reward_mean"] == pytest.approx(4 / 8)


def test_a_reward_that_grades_nothing_gives_no_accuracy() -> None:
    m = summarize([sample(0, 3, None, 0.5), sample(1, 3, None, 1.0)], n=1)
    assert "accuracy" not in m and "pass@1" not in m
    assert m["reward_mean"] == pytest.approx(0.75)


def test_a_failed_reward_counts_as_wrong() -> None:
    failed = sample(1, 3, None, 0.0)
    failed.reward_info = {"error": "boom"}
    m = summarize([sample(0, 3, True, 1.0), failed], n=1)
    assert m["accuracy"] == pytest.approx(0.5) and m["reward_errors"] == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"n": 0}, "--n must be at least 1"),
        ({"n": 4, "temperature": 0.0}, "greedy decoding gives the same answer"),
        ({"temperature": -0.5}, "--temperature must be >= 0"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1]"),
        ({"max_new_tokens": 0}, "--max-new-tokens must be at least 1"),
        ({"max_rows": 0}, "--max-rows must be at least 1"),
        ({"backend": "trt"}, "valid: hf, vllm"),
        ({"reward": "mathh"}, "did you mean 'math'"),
    ],
)
def test_bad_settings(settings: dict, message: str) -> None:
    with pytest.raises(UsageError) as info:
        check_settings(EvalSettings(data="x.jsonl", **settings))
    assert message in info.value.message and info.value.exit_code == 2


def test_temperature_defaults() -> None:
    assert check_settings(EvalSettings(data="x")).temperature == 0.0
    assert check_settings(EvalSettings(data="x", n=8)).temperature == 1.0
    assert check_settings(EvalSettings(data="x", reward="pkg.mod:fn")).reward == "pkg.mod:fn"


def test_default_output_paths(tmp_path: Path) -> None:
    greedy = check_settings(EvalSettings(data="data/tiny-arith/test.jsonl"))
    sampled = check_settings(EvalSettings(data="data/tiny-arith/test.jsonl", n=8, temperature=0.7))
    run = Run(tmp_path / "runs" / "my-run")
    from_run = ResolvedModel(path="x", label="run my-run (final)", run=run)
    assert default_out_path(from_run, greedy) == run.dir / "eval" / "test.jsonl"
    assert default_out_path(from_run, sampled) == run.dir / "eval" / "test-n8-t0.7.jsonl"
    plain = ResolvedModel(path="builtin:tiny-qwen3", label="builtin:tiny-qwen3")
    assert default_out_path(plain, greedy) == Path("eval-builtin_tiny-qwen3-test.jsonl")
    assert summary_path(Path("a/b.jsonl")) == Path("a/b.summary.json")
