"""Recipe section ``reward``: which reward function scores each data domain.

Each dataset row carries a ``domain`` (``math``, ``code``, ...); ``reward.domains`` maps a
domain to one reward function or a weighted sum of several. The defaults score
``domain: math`` rows with the math-verify rule reward, so the tiny arithmetic data works
with no ``reward`` section at all. See docs/rewards.md.

```yaml
reward:
  domains:
    math:                                # rows with domain: math
      rewards:
        - {name: math, weight: 1.0}
        - {name: format, weight: 0.1, pattern: '.*The answer is \\d+\\.'}
      timeout_s: 5
    puzzles: my_pkg.rewards:score_puzzle # shorthand: one function, weight 1
    code:                                # runs the program against the row's `tests`
      rewards: [{name: code, code: {score: pass_fraction}}]
```

The options of `code`, `judge`, `instructions`, `choice` and `repetition` live in
:mod:`roll_core.config.reward_options`.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from roll_core.config.reward_options import (
    ChoiceConfig,
    CodeRewardConfig,
    ExactMatchConfig,
    InstructionsConfig,
    JudgeConfig,
    RepetitionConfig,
)
from roll_core.config.schema import Strict

__all__ = [
    "BUILTIN_REWARDS",
    "ChoiceConfig",
    "CodeRewardConfig",
    "DomainRewardConfig",
    "InstructionsConfig",
    "JudgeConfig",
    "RepetitionConfig",
    "RewardConfig",
    "RewardFnConfig",
]

BUILTIN_REWARDS: dict[str, tuple[str, ...]] = {
    "math": ("answer_pattern", "answer_key"),
    "format": ("pattern",),
    "code": ("code",),
    "judge": ("judge",),
    "instructions": ("instructions",),
    "choice": ("answer_key", "choice"),
    "repetition": ("repetition",),
    "exact_match": ("answer_key", "exact_match"),
}
"""Built-in reward name -> its options. The config layer sits below ``roll_core.rewards`` and
does not import it; a test keeps this equal to ``roll_core.rewards.REWARDS``."""

DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""``pkg.module:function`` (the part after ``:`` may be a dotted attribute path)."""
_OPTION_DEFAULTS: dict[str, Any] = {
    "answer_pattern": None,
    "answer_key": "answer",
    "pattern": None,
    "args": {},
    "code": None,
    "judge": None,
    "instructions": None,
    "choice": None,
    "repetition": None,
    "exact_match": None,
}
SELF_BOUNDED = ("code", "judge")
"""Rewards that bound their own work (subprocesses, HTTP timeouts) and keep state across
calls (adaptive timeouts, a client or a model): their domains run under thread isolation
unless the recipe says otherwise."""


def check_reward_name(name: str) -> str:
    """Return ``name`` if it is a built-in reward or a ``pkg.module:function`` path.

    Raises:
        ValueError: with the valid names and the closest match (pydantic turns it into a
            recipe error that names the key).
    """
    if name in BUILTIN_REWARDS or DOTTED_PATH.match(name):
        return name
    close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"unknown reward {name!r}; {guess}valid names: {', '.join(BUILTIN_REWARDS)}, "
        "or a user function as a dotted path 'pkg.module:function'"
    )


class RewardFnConfig(Strict):
    """One reward function and its weight in its domain's sum."""

    name: str = Field(
        description="A built-in reward (`math`: math-verify rule reward; `format`: regex "
        "match of the whole response; `code`: run the program against the row's tests; "
        "`judge`: an LLM judge; `instructions`: instruction-following checks; `choice`: "
        "multiple-choice letter; `repetition`: repeated n-gram penalty; `exact_match`: the "
        "response equals the answer, after optional normalisation) or a user function "
        "`pkg.module:function` returning a float or a `RewardResult`."
    )
    weight: float = Field(
        default=1.0, description="Weight of this function in the domain's weighted sum."
    )
    answer_pattern: str | None = Field(
        default=None,
        description="`math` only: regex for the final answer when the response has no "
        "`\\boxed{}` (named group `answer`, else group 1, else the whole match; the last "
        "match wins). None: the last number in the response.",
    )
    answer_key: str = Field(
        default="answer", description="`math` only: the row column with the reference answer."
    )
    pattern: str | None = Field(
        default=None,
        description="`format` only: regex the whole response must match (`.` matches "
        "newlines). None: `<think>...</think><answer>...</answer>`.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="User functions only: keyword arguments, called as `fn(sample, **args)`.",
    )
    code: CodeRewardConfig | None = Field(
        default=None, description="`code` only: test-case format, scoring, timeouts, sandbox."
    )
    judge: JudgeConfig | None = Field(
        default=None, description="`judge` only: endpoint or model, prompt, score parsing."
    )
    instructions: InstructionsConfig | None = Field(
        default=None, description="`instructions` only: where the constraints come from."
    )
    choice: ChoiceConfig | None = Field(
        default=None, description="`choice` only: the option letters."
    )
    repetition: RepetitionConfig | None = Field(
        default=None, description="`repetition` only: n-gram size."
    )
    exact_match: ExactMatchConfig | None = Field(
        default=None, description="`exact_match` only: strip, case and whitespace folding."
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @field_validator("name")
    @classmethod
    def _known_name(cls, value: str) -> str:
        return check_reward_name(value)

    @field_validator("answer_pattern", "pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value, re.DOTALL)
            except re.error as err:
                raise ValueError(f"{value!r} is not a valid regular expression: {err}") from None
        return value

    @model_validator(mode="after")
    def _options_apply(self) -> RewardFnConfig:
        allowed = BUILTIN_REWARDS.get(self.name, ("args",))
        for option, default in _OPTION_DEFAULTS.items():
            if option not in allowed and getattr(self, option) != default:
                users = [n for n, opts in BUILTIN_REWARDS.items() if option in opts] or ["user"]
                raise ValueError(
                    f"{option!r} does not apply to reward {self.name!r}; it is an option of "
                    f"{' and '.join(users)} rewards only"
                )
        return self


class DomainRewardConfig(Strict):
    """How the rows of one domain are scored: a weighted sum of reward functions."""

    rewards: list[RewardFnConfig] = Field(
        default_factory=lambda: [RewardFnConfig(name="math")],
        min_length=1,
        description="Reward functions; the sample's reward is the weighted sum of their "
        "scores. A bare string (`math`, `pkg.mod:fn`) stands for `{name: ...}`, and may also "
        "replace the whole domain section (one function, weight 1).",
    )
    timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Wall-clock bound for scoring one sample (all its functions). A sample "
        "that takes longer gets reward 0 and counts in `reward/<domain>/timeouts`. Unset in "
        "a domain with `code` or `judge`: derived from their own bounds (code: 4 x "
        "max_sample_s + 30; judge: (retries + 1) x (request_timeout_s + backoff) x 4 + 30), "
        "since a sample may wait for a free sandbox or judge slot.",
    )
    isolation: Literal["process", "thread"] | None = Field(
        default=None,
        description="How this domain's functions run (see reward.isolation). None: `thread` "
        "for domains with `code` or `judge` (they bound their own work and keep state), "
        "else reward.isolation.",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"rewards": [{"name": data}]}
        if isinstance(data, list):
            return {"rewards": data}
        return data

    @model_validator(mode="after")
    def _self_bounded_timeout(self) -> DomainRewardConfig:
        bound = 0.0
        for fn in self.rewards:
            if fn.name == "code":
                bound = max(bound, 4 * (fn.code or CodeRewardConfig()).max_sample_s + 30)
            elif fn.name == "judge":
                j = fn.judge or JudgeConfig()
                per_try = j.request_timeout_s + j.retry_backoff_s * 2**j.retries
                bound = max(bound, 4 * (j.retries + 1) * per_try + 30)
        if bound and "timeout_s" not in self.model_fields_set:
            self.timeout_s = bound
        return self

    def effective_isolation(self, default: Literal["process", "thread"]) -> str:
        """``isolation``, or its default for this domain's functions (see the field)."""
        if self.isolation is not None:
            return self.isolation
        if any(fn.name in SELF_BOUNDED for fn in self.rewards):
            return "thread"
        return default


class RewardConfig(Strict):
    """Rewards per data domain, and how reward functions are run."""

    domains: dict[str, DomainRewardConfig] = Field(
        default_factory=lambda: {"math": DomainRewardConfig()},
        min_length=1,
        description="Domain name (the row's `domain` value) -> how its rows are scored. "
        "Default: `math` rows get the math-verify rule reward.",
    )
    domain_key: str = Field(default="domain", description="Row column holding the domain.")
    default_domain: str | None = Field(
        default=None,
        description="Domain for rows without a domain value (no `domain_key` column, or "
        "a null value). Left out with exactly one configured domain: that domain. Left out "
        "with several: rows without a domain are an error (at `roll validate` for local "
        "data), or, when the data is not known in advance, get reward 0 and are counted in "
        "`reward/unknown_domain/count`.",
    )
    isolation: Literal["process", "thread"] = Field(
        default="process",
        description="`process`: reward functions run in a pool of worker processes; one that "
        "overruns its timeout is killed and replaced. `thread`: they run in threads of this "
        "process (for functions that cannot be pickled, or hold a model); an overrunning "
        "call is abandoned, not stopped.",
    )
    num_workers: int = Field(
        default=2,
        ge=1,
        description="Worker processes (`process` isolation): how many samples are scored at "
        "the same time.",
    )

    @model_validator(mode="after")
    def _default_domain_known(self) -> RewardConfig:
        if self.default_domain is None and len(self.domains) == 1:
            self.default_domain = next(iter(self.domains))  # the only reward there is
        if self.default_domain is not None and self.default_domain not in self.domains:
            raise ValueError(
                f"default_domain {self.default_domain!r} is not one of the configured "
                f"domains ({', '.join(sorted(self.domains))})"
            )
        return self
