"""Reward functions and the domain router (issue 3, RLVR).

* :class:`RewardSample` / :class:`RewardResult`: the interface (``base``).
* ``math`` (math-verify rule reward), ``format`` (regex), user functions by dotted path,
  weighted sums (``registry``).
* :class:`RewardRouter`: domain routing, timeouts, failure counters, metrics (``router``),
  with the bounded runners in ``execution``.
* ``code`` (programs against test cases in the :class:`Sandbox`, adaptive timeouts),
  ``judge`` (LLM-as-judge over an OpenAI-compatible endpoint or a local hf model), and the
  rule rewards ``instructions``, ``choice``, ``repetition`` (``rules``).

Nothing here imports the engine, pipelines, workers or Ray. See docs/rewards.md.
"""

from roll_core.rewards.base import RewardFn, RewardResult, RewardSample, as_result
from roll_core.rewards.code import AdaptiveTimeout, CodeReward, extract_code, parse_tests
from roll_core.rewards.execution import Outcome, ProcessRunner, ThreadRunner
from roll_core.rewards.format_reward import DEFAULT_FORMAT_PATTERN, FormatReward
from roll_core.rewards.judge import JudgeReward
from roll_core.rewards.math_reward import (
    MathReward,
    answers_match,
    extract_answer,
    extract_boxed,
    extract_last_number,
)
from roll_core.rewards.registry import (
    REWARDS,
    UserReward,
    WeightedSum,
    build_domain_reward,
    build_reward,
    load_user_function,
)
from roll_core.rewards.router import DomainStats, RewardRouter, domain_metrics
from roll_core.rewards.rules import ChoiceReward, InstructionsReward, RepetitionPenalty
from roll_core.rewards.sandbox import Sandbox, SandboxLimits, TestCase

__all__ = [
    "DEFAULT_FORMAT_PATTERN",
    "AdaptiveTimeout",
    "ChoiceReward",
    "CodeReward",
    "InstructionsReward",
    "JudgeReward",
    "RepetitionPenalty",
    "Sandbox",
    "SandboxLimits",
    "TestCase",
    "extract_code",
    "parse_tests",
    "REWARDS",
    "DomainStats",
    "FormatReward",
    "MathReward",
    "Outcome",
    "ProcessRunner",
    "RewardFn",
    "RewardResult",
    "RewardRouter",
    "RewardSample",
    "ThreadRunner",
    "UserReward",
    "WeightedSum",
    "answers_match",
    "as_result",
    "build_domain_reward",
    "build_reward",
    "domain_metrics",
    "extract_answer",
    "extract_boxed",
    "extract_last_number",
    "load_user_function",
]
