"""Options of the built-in rewards beyond math: ``code``, ``judge``, ``instructions``,
``choice`` and ``repetition`` (each a sub-section named like the reward). See docs/rewards.md.

```yaml
reward:
  domains:
    code:
      rewards:
        - name: code
          code:
            score: pass_fraction
            timeout: {min_s: 1, max_s: 10, lam: 3}
            sandbox: {mode: auto, memory_mb: 512, max_concurrent: 4}
```
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from roll_core.config.schema import Strict

__all__ = [
    "AdaptiveTimeoutConfig",
    "ChoiceConfig",
    "CodeRewardConfig",
    "InstructionsConfig",
    "JudgeConfig",
    "RepetitionConfig",
    "SandboxConfig",
]

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response to a question. Compare it with the reference answer and "
    "rate its correctness and quality on a scale from {scale_min} to {scale_max} "
    "({scale_max} = fully correct).\n\n"
    "Question:\n{question}\n\nReference answer:\n{reference}\n\nResponse:\n{response}\n\n"
    "Reply with one line of the form `Score: <number>` and nothing else."
)


class AdaptiveTimeoutConfig(Strict):
    """Per-test-case timeout: ``min(max(min_s, lam * T_anchor), max_s)`` (RollPacker).

    ``T_anchor`` is the slowest *passing* test-case run seen so far for the same problem
    (``scope: problem``) or for any problem (``scope: global``); until one has passed, the
    timeout is ``max_s``. With ``adaptive: false`` every case gets ``max_s``.
    """

    adaptive: bool = Field(
        default=True, description="Adapt the timeout to the slowest passing run (else: max_s)."
    )
    min_s: float = Field(default=1.0, gt=0, description="T_min: the smallest timeout, seconds.")
    max_s: float = Field(
        default=10.0, gt=0, description="T_max: the largest timeout (and the first), seconds."
    )
    lam: float = Field(
        default=3.0, ge=1.0, description="lambda: the timeout is lam times the anchor."
    )
    scope: Literal["problem", "global"] = Field(
        default="problem",
        description="`problem`: one anchor per problem (its test cases); `global`: one for all.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> AdaptiveTimeoutConfig:
        if self.min_s > self.max_s:
            raise ValueError(f"min_s ({self.min_s}) is larger than max_s ({self.max_s})")
        return self


class SandboxConfig(Strict):
    """Where and under which limits generated programs run (docs/rewards.md: the modes)."""

    mode: Literal["auto", "namespaces", "rlimits"] = Field(
        default="auto",
        description="`namespaces`: user/mount/network/PID namespaces and a minimal root (no "
        "network, no host file, own process tree); `rlimits`: resource limits, a seccomp "
        "filter (no new process, signal or socket) and Landlock where the kernel has it "
        "(docs/rewards.md: what it does not protect); `auto`: namespaces when a probe shows "
        "they work.",
    )
    memory_mb: int = Field(default=512, ge=32, description="Address-space limit per process, MiB.")
    max_processes: int = Field(
        default=8,
        ge=1,
        description="Processes and threads a program may have in `namespaces` mode (fork "
        "bombs stop here); `rlimits` mode allows no new process.",
    )
    max_file_mb: int = Field(default=16, ge=1, description="Largest file a program may write, MiB.")
    max_output_kb: int = Field(
        default=1024, ge=1, description="Stdout kept per case, KiB; more kills the program."
    )
    work_dir_mb: int = Field(
        default=64, ge=1, description="Size of the work directory tmpfs (namespaces mode), MiB."
    )
    max_concurrent: int = Field(
        default=2, ge=1, description="Executions at once (the sandbox pool); others wait."
    )
    python: str | None = Field(
        default=None, description="Interpreter for programs. None: the one running roll."
    )
    site_packages: bool = Field(
        default=False,
        description="Let programs import installed packages (numpy...); default: the "
        "standard library only (`python -S`, faster start).",
    )
    run_as_uid: int = Field(
        default=65534, ge=1, description="Uid (and gid) programs run as when roll runs as root."
    )


class CodeRewardConfig(Strict):
    """``code``: run the response's program against the row's test cases."""

    tests_key: str = Field(
        default="tests",
        description="Row column with the test cases: a list of assert statements, a list "
        "of {input, output} pairs, or {inputs: [...], outputs: [...]} (a JSON string of "
        "these is accepted too).",
    )
    score: Literal["all_pass", "pass_fraction"] = Field(
        default="all_pass",
        description="`all_pass`: 1 when every case passes (stops at the first failure); "
        "`pass_fraction`: the fraction of cases that pass.",
    )
    compare: Literal["lines", "tokens", "exact"] = Field(
        default="lines",
        description="Stdout comparison: `lines` ignores trailing spaces and blank lines, "
        "`tokens` compares whitespace-separated tokens, `exact` bytes.",
    )
    require_code_block: bool = Field(
        default=True,
        description="The program is the last ```python (or bare ```) block; without one the "
        "response scores 0. False: a response without a block is the program itself.",
    )
    max_sample_s: float = Field(
        default=60.0,
        gt=0,
        description="Time budget for all cases of one response; cases beyond it fail.",
    )
    timeout: AdaptiveTimeoutConfig = Field(
        default_factory=AdaptiveTimeoutConfig, description="Per-case timeout."
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Sandbox.")


class JudgeConfig(Strict):
    """``judge``: another model scores the response (an OpenAI-compatible server or hf)."""

    backend: Literal["http", "hf"] = Field(
        default="http",
        description="`http`: an OpenAI-compatible /v1/chat/completions endpoint (vLLM, "
        "SGLang, a hosted API); `hf`: a transformers model loaded in this process "
        "(needs `isolation: thread`).",
    )
    base_url: str = Field(
        default="http://127.0.0.1:8000/v1", description="`http`: the server's /v1 URL."
    )
    model: str = Field(
        default="judge",
        description="`http`: the served model name; `hf`: a model path or builtin:NAME.",
    )
    api_key_env: str | None = Field(
        default=None,
        description="`http`: name of the environment variable holding the API key (the key "
        "itself never goes in a recipe). None: no key.",
    )
    template: str = Field(
        default=DEFAULT_JUDGE_TEMPLATE,
        description="Prompt; fields {question}, {reference}, {response}, {scale_min}, {scale_max}.",
    )
    system_prompt: str | None = Field(default=None, description="Optional system message.")
    question_key: str = Field(
        default="prompt", description="Row column with the question (else the prompt text)."
    )
    reference_key: str = Field(
        default="answer", description="Row column with the reference answer (may be absent)."
    )
    scale_min: float = Field(default=0.0, description="Lowest score the judge may give.")
    scale_max: float = Field(default=10.0, description="Highest score the judge may give.")
    score_pattern: str = Field(
        default=r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)",
        description="Regex finding the score in the reply (group 1; the last match wins).",
    )
    normalize: bool = Field(
        default=True,
        description="Map the score to [0, 1]: (s - scale_min) / (scale_max - scale_min).",
    )
    max_tokens: int = Field(default=64, ge=1, description="Tokens the judge may generate.")
    temperature: float = Field(default=0.0, ge=0, description="Judge sampling temperature.")
    request_timeout_s: float = Field(default=30.0, gt=0, description="`http`: per request.")
    retries: int = Field(
        default=2, ge=0, description="`http`: retries after a timeout, 429 or 5xx reply."
    )
    retry_backoff_s: float = Field(
        default=1.0, ge=0, description="`http`: wait before retry k is backoff * 2**k."
    )
    max_concurrent: int = Field(default=4, ge=1, description="Judge calls at once.")
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="`http`: extra request fields, e.g. vLLM's `structured_outputs: {regex: "
        "'Score: (10|[0-9])'}` to force the reply's form, or `response_format`.",
    )

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as err:
            raise ValueError(f"{value!r} is not a valid regular expression: {err}") from None
        if compiled.groups < 1:
            raise ValueError("score_pattern needs a group around the number, e.g. 'Score: (\\d+)'")
        return value

    @field_validator("template")
    @classmethod
    def _fields_known(cls, value: str) -> str:
        known = {"question", "reference", "response", "scale_min", "scale_max"}
        try:
            value.format(**dict.fromkeys(known, ""))
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"template has an unknown or malformed field ({err}); known: "
                f"{', '.join(sorted(known))} (write literal braces as {{{{ and }}}})"
            ) from None
        if "{response}" not in value:
            raise ValueError("template must contain {response}")
        return value

    @model_validator(mode="after")
    def _scale(self) -> JudgeConfig:
        if self.scale_max <= self.scale_min:
            raise ValueError(
                f"scale_max ({self.scale_max}) must exceed scale_min ({self.scale_min})"
            )
        return self


class InstructionsConfig(Strict):
    """``instructions``: instruction-following checks (length, keywords, JSON, language).

    The constraints come from the row's ``constraints_key`` column (a list like
    ``[{type: max_words, value: 50}, {type: keywords, include: [...]}]``) plus the fixed
    ``constraints`` here, which apply to every row of the domain.
    """

    constraints_key: str = Field(
        default="constraints", description="Row column with the row's constraints (optional)."
    )
    constraints: list[dict[str, object]] = Field(
        default_factory=list, description="Constraints for every row (same form)."
    )
    score: Literal["all", "fraction"] = Field(
        default="fraction", description="`all`: 1 only if every check passes; `fraction`."
    )


class ChoiceConfig(Strict):
    """``choice``: multiple-choice letter extraction compared with the row's answer."""

    letters: str = Field(default="ABCD", min_length=2, description="The valid option letters.")

    @field_validator("letters")
    @classmethod
    def _upper_letters(cls, value: str) -> str:
        if not value.isalpha() or not value.isupper() or len(set(value)) != len(value):
            raise ValueError(f"letters must be distinct capital letters, got {value!r}")
        return value


class RepetitionConfig(Strict):
    """``repetition``: a penalty, ``-(repeated n-grams / n-grams)``, in [-1, 0]."""

    ngram: int = Field(default=4, ge=1, description="n-gram size, in whitespace tokens.")
    min_tokens: int = Field(
        default=8, ge=1, description="Responses shorter than this get no penalty."
    )


class ExactMatchConfig(Strict):
    """``exact_match``: the response equals the row's answer after these normalisations
    (applied to both). Stricter than ``math``, which extracts and compares a number."""

    strip: bool = Field(
        default=True, description="Remove leading and trailing whitespace of both first."
    )
    ignore_case: bool = Field(default=False, description="Compare case-insensitively.")
    collapse_whitespace: bool = Field(
        default=False, description="Count every run of whitespace as one space."
    )
