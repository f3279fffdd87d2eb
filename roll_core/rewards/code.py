"""Code reward: run the response's Python program against the row's test cases, sandboxed.

* **Program.** The last fenced block tagged ``python``/``py``/``python3`` (or untagged) in
  the text after the last ``</think>``; without one the response scores 0
  (``require_code_block``), or the whole response is the program.
* **Tests** (row column ``tests_key``): assert statements run after the program in its
  namespace (``["assert add(1, 2) == 3", ...]``), or stdin/stdout pairs
  (``[{"input": "1 2\\n", "output": "3\\n"}, ...]``, the APPS/TACO form
  ``{"inputs": [...], "outputs": [...]}`` or the CodeContests form ``{"input": [...],
  "output": [...]}``); a JSON string of any of these is accepted.
  Malformed tests are a :class:`~roll_core.errors.DataError` from :func:`parse_tests`, which
  :meth:`CodeReward.check_row` calls at data loading.
* **Score.** ``all_pass``: 1.0 when every case passes (cases after the first failure are not
  run); ``pass_fraction``: passed / cases.
* **Timeouts** (RollPacker, arXiv 2509.21009, "adaptive timeout"): per case
  ``min(max(T_min, lam * T_anchor), T_max)`` where ``T_anchor`` is the slowest passing case
  run of the problem (or of all problems); ``T_max`` until a case has passed. Departure from
  the paper: the anchor is per test case run (a program is run once per case), and it only
  grows (a problem's slowest passing run so far).
* Every execution goes through :class:`~roll_core.rewards.sandbox.Sandbox` (limits,
  isolation, the bounded pool). ``metrics()`` reports pass rates, timeouts, sandbox errors
  and execution-time percentiles since the last call.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_core.config.reward_options import AdaptiveTimeoutConfig, CodeRewardConfig
from roll_core.errors import DataError
from roll_core.rewards.base import RewardResult, RewardSample
from roll_core.rewards.sandbox import ExecutionResult, Sandbox, SandboxLimits, TestCase

__all__ = ["AdaptiveTimeout", "CodeReward", "extract_code", "parse_tests", "percentiles"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3"}
_HOW = (
    "Tests are a list of assert statements (['assert f(1) == 2']), a list of "
    "{'input': ..., 'output': ...} pairs, or {'inputs': [...], 'outputs': [...]} "
    "(also {'input': [...], 'output': [...]}, as in CodeContests)."
)


def extract_code(text: str) -> str | None:
    """The last fenced Python (or untagged) block after the last ``</think>``, or None
    (also for a response that opens ``<think>`` and never closes it)."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return None
    blocks = [body for tag, body in _FENCE.findall(text) if tag.lower() in _PYTHON_TAGS]
    if not blocks or not blocks[-1].strip():
        return None
    return blocks[-1]


def parse_tests(value: Any, *, where: str = "row") -> tuple[TestCase, ...]:
    """The test cases of a row's tests column (see the module docstring).

    Raises:
        DataError: missing, empty, or not one of the accepted forms (the message says which
            element is wrong and shows the accepted forms).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{where}: the tests are a string but not JSON ({err}).", hint=_HOW
            ) from None
    if isinstance(value, Mapping) and "fn_name" in value:
        raise DataError(
            f"{where}: call-based tests (fn_name) are not supported; use stdin/stdout or "
            "assert tests.",
            hint="Filter those rows out, or rewrite them as assert statements.",
        )
    plural = isinstance(value, Mapping) and set(value) >= {"inputs", "outputs"}
    if plural or (isinstance(value, Mapping) and set(value) == {"input", "output"}):
        assert isinstance(value, Mapping)
        inputs, outputs = (
            (value["inputs"], value["outputs"]) if plural else (value["input"], value["output"])
        )
        if (
            not isinstance(inputs, list)
            or not isinstance(outputs, list)
            or len(inputs) != len(outputs)
        ):
            raise DataError(
                f"{where}: the inputs and outputs must be lists of the same length.", hint=_HOW
            )
        value = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(value, list) or not value:
        shown = "nothing" if value is None else f"{type(value).__name__} {str(value)[:80]!r}"
        raise DataError(f"{where}: expected a non-empty list of tests, got {shown}.", hint=_HOW)
    cases = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item.strip():
            try:
                compile(item, f"test {i}", "exec")
            except SyntaxError as err:
                raise DataError(
                    f"{where}: test {i} is not valid Python ({err.msg}): {item[:80]!r}.", hint=_HOW
                ) from None
            cases.append(TestCase("assert", test=item))
        elif isinstance(item, Mapping) and set(item) == {"input", "output"}:
            if not all(isinstance(item[k], str) for k in ("input", "output")):
                raise DataError(f"{where}: test {i}: input and output must be strings.", hint=_HOW)
            cases.append(TestCase("stdio", stdin=item["input"], stdout=item["output"]))
        else:
            raise DataError(f"{where}: test {i} is not a test: {str(item)[:80]!r}.", hint=_HOW)
    return tuple(cases)


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[int, float]:
    """Nearest-rank percentiles: the smallest value with at least q% of values <= it."""
    ordered = sorted(values)
    if not ordered:
        return {}
    return {int(q): ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] for q in qs}


class AdaptiveTimeout:
    """``min(max(T_min, lam * T_anchor), T_max)`` with anchors per problem or global; thread-safe."""

    def __init__(self, cfg: AdaptiveTimeoutConfig) -> None:
        self.cfg = cfg
        self._anchors: dict[str, float] = {}
        self._lock = threading.Lock()

    def _key(self, problem: str) -> str:
        return problem if self.cfg.scope == "problem" else ""

    def timeout(self, problem: str) -> float:
        """The timeout for one test case of ``problem``, in seconds."""
        if not self.cfg.adaptive:
            return self.cfg.max_s
        with self._lock:
            anchor = self._anchors.get(self._key(problem))
        if anchor is None:
            return self.cfg.max_s
        return min(max(self.cfg.min_s, self.cfg.lam * anchor), self.cfg.max_s)

    def observe(self, problem: str, seconds: float) -> None:
        """Record a *passing* case run of ``problem`` that took ``seconds``."""
        with self._lock:
            key = self._key(problem)
            self._anchors[key] = max(seconds, self._anchors.get(key, 0.0))

    def anchor(self, problem: str) -> float | None:
        """The current anchor for ``problem`` (None before a passing run)."""
        with self._lock:
            return self._anchors.get(self._key(problem))


@dataclass
class _Window:
    samples: int = 0
    solved: int = 0
    no_code: int = 0
    cases: int = 0
    passed: int = 0
    timeouts: int = 0
    sandbox_errors: int = 0
    limits: int = 0
    seconds: list[float] = field(default_factory=list)
    timeout_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class CodeReward:
    """The ``code`` reward (options: :class:`~roll_core.config.reward.CodeRewardConfig`).

    ``info``: ``correct`` (every case passed), ``format_ok`` (a program was found),
    ``passed``, ``cases``, ``timeouts``, ``sandbox_error``, ``statuses``.
    """

    code: CodeRewardConfig | None = None
    _state: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_state", {})

    @property
    def cfg(self) -> CodeRewardConfig:
        """The options (defaults when none were given)."""
        return self.code or CodeRewardConfig()

    def _runtime(self) -> tuple[Sandbox, AdaptiveTimeout, threading.Lock]:
        state = self._state
        if "sandbox" not in state:  # built on first use: picklable until then
            with _BUILD_LOCK:
                if "sandbox" not in state:
                    s = self.cfg.sandbox
                    limits = SandboxLimits(
                        memory_mb=s.memory_mb,
                        max_processes=s.max_processes,
                        max_file_mb=s.max_file_mb,
                        max_output_bytes=s.max_output_kb << 10,
                        work_dir_mb=s.work_dir_mb,
                    )
                    state["lock"] = threading.Lock()
                    state["window"] = _Window()
                    state["timeouts"] = AdaptiveTimeout(self.cfg.timeout)
                    state["sandbox"] = Sandbox(
                        mode=s.mode,
                        limits=limits,
                        max_concurrent=s.max_concurrent,
                        python=s.python,
                        site_packages=s.site_packages,
                        compare=self.cfg.compare,
                        run_as_uid=s.run_as_uid,
                    )
        return state["sandbox"], state["timeouts"], state["lock"]

    def __getstate__(self) -> dict[str, Any]:
        return {"code": self.code}

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "code", state["code"])
        object.__setattr__(self, "_state", {})

    def warmup(self) -> None:
        """Resolve the sandbox mode (an ``auto`` probe runs one program)."""
        sandbox, _, _ = self._runtime()
        _ = sandbox.mode

    def check_row(self, row: Mapping[str, Any], where: str = "row") -> None:
        """Raise :class:`DataError` when the row's tests are missing or malformed."""
        key = self.cfg.tests_key
        if key not in row:
            raise DataError(
                f"{where} has no {key!r} column (columns: {sorted(row)}); code rows need "
                "test cases.",
                hint="Add the tests, or set the code reward's tests_key.",
            )
        parse_tests(row[key], where=where)

    def __call__(self, sample: RewardSample) -> RewardResult:
        cfg = self.cfg
        sandbox, timeouts, lock = self._runtime()
        tests_value = sample.row.get(cfg.tests_key)
        cases = parse_tests(tests_value, where=f"row {sample.row.get('id', '')}".strip())
        program = extract_code(sample.response)
        if program is None and not cfg.require_code_block:
            program = sample.response
        if program is None:
            with lock:
                self._window().samples += 1
                self._window().no_code += 1
            empty = {"correct": False, "format_ok": False, "passed": 0, "cases": len(cases)}
            return RewardResult(0.0, {**empty, "timeouts": 0, "sandbox_error": None})
        problem = _problem_key(tests_value)
        per_case = timeouts.timeout(problem)
        budget = cfg.max_sample_s
        case_timeouts = []
        for _ in cases:  # the per-sample budget caps the sum of case timeouts
            case_timeouts.append(max(0.05, min(per_case, budget)))
            budget = max(0.0, budget - per_case)
        result = sandbox.run(program, cases, case_timeouts, stop_on_fail=cfg.score == "all_pass")
        for case in result.cases:
            if case.status == "pass":
                timeouts.observe(problem, case.seconds)
        self._record(result, per_case)
        passed = result.passed
        score = float(result.all_passed) if cfg.score == "all_pass" else passed / len(result.cases)
        info: dict[str, Any] = {
            "correct": result.all_passed,
            "format_ok": True,
            "passed": passed,
            "cases": len(result.cases),
            "timeouts": result.timeouts,
            "sandbox_error": result.sandbox_error,
            "statuses": [c.status for c in result.cases],
            "timeout_s": per_case,
        }
        return RewardResult(score, info)

    def _window(self) -> _Window:
        return self._state["window"]

    def _record(self, result: ExecutionResult, timeout: float) -> None:
        _, _, lock = self._runtime()
        with lock:
            w = self._window()
            w.samples += 1
            w.solved += int(result.all_passed)
            w.sandbox_errors += int(result.sandbox_error is not None)
            w.timeout_s.append(timeout)
            for case in result.cases:
                if case.status == "not_run":
                    continue
                w.cases += 1
                w.passed += case.status == "pass"
                w.timeouts += case.status == "timeout"
                w.limits += case.status in ("output_limit", "file_limit")
                if case.status != "sandbox_error":
                    w.seconds.append(case.seconds)

    def metrics(self, *, reset: bool = True) -> dict[str, float]:
        """Since the last call: ``pass_rate`` (solved responses), ``case_pass_rate``,
        ``no_code``, ``executions`` (case runs), ``timeouts``, ``limit_kills``,
        ``sandbox_errors``, ``exec_ms_p50/p90/p99``, ``timeout_s_mean``; keys without the
        ``reward/<domain>/`` prefix the router adds."""
        if "window" not in self._state:
            return {}
        _, _, lock = self._runtime()
        with lock:
            w = self._window()
            if reset:
                self._state["window"] = _Window()
        if not w.samples:
            return {}
        out = {
            "code/pass_rate": w.solved / w.samples,
            "code/no_code": float(w.no_code),
            "code/executions": float(w.cases),
            "code/timeouts": float(w.timeouts),
            "code/limit_kills": float(w.limits),
            "code/sandbox_errors": float(w.sandbox_errors),
        }
        if w.cases:
            out["code/case_pass_rate"] = w.passed / w.cases
        for q, v in percentiles(w.seconds).items():
            out[f"code/exec_ms_p{q}"] = 1000.0 * v
        if w.timeout_s:
            out["code/timeout_s_mean"] = sum(w.timeout_s) / len(w.timeout_s)
        return out

    @property
    def sandbox(self) -> Sandbox:
        """The sandbox (built on first use)."""
        return self._runtime()[0]

    @property
    def timeouts(self) -> AdaptiveTimeout:
        """The adaptive timeout state."""
        return self._runtime()[1]


_BUILD_LOCK = threading.Lock()


def _problem_key(tests: Any) -> str:
    """A problem is identified by its tests (the same prompt has the same tests)."""
    text = tests if isinstance(tests, str) else json.dumps(tests, sort_keys=True, default=str)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()
