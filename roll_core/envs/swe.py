"""The coding env: fix a bug in a repository through native tool calls, graded by hidden tests.

Each episode draws one SWE task (:mod:`roll_core.swe`) from ``tasks`` (a folder made by
``roll data swe``, a folder of task folders, or SWE-bench-style JSONL; by default a small set
generated once into the roll cache) and copies its repository into a fresh sandbox
(:mod:`roll_core.sandbox`). The first observation is the issue text. The model calls tools in
its own format (``tool_parser``, default ``hermes``):

* ``bash(command)``: runs in the repository (``/workspace``) with the sandbox's limits,
  ``command_timeout_s`` each; the result is the exit code and the output;
* ``editor(command, path, ...)``: ``view`` a file (numbered lines, ``view_range``) or a
  directory, ``create`` a file (``file_text``), ``str_replace`` (``old_str`` must occur exactly
  once; ``new_str``);
* ``submit()``: ends the episode; the workspace's diff is graded.

Observations longer than ``max_output_chars`` are cut with a note saying how much was left
out. A response without a tool call or a malformed call is an invalid action
(``format_penalty``); an editor call that cannot be done (no such file, ``old_str`` not found
or not unique) answers ``error: ...`` and counts as a tool error.
Budgets: ``max_steps`` turns and ``time_budget_s`` seconds of wall time; when either runs out
the episode is truncated and, with ``grade_on_truncation``, the diff so far is graded.

Reward: :func:`roll_core.swe.grading.grade` of the diff, in a **fresh** sandbox (1 when
every fail-to-pass test passes and every pass-to-pass test still does; ``partial_credit``:
the share, see docs/swe.md). The episode's last ``info`` carries ``episode_metrics``:
``solved``, ``steps``, ``diff_lines``, ``tool_errors`` (failed editor calls), ``timeouts``
(commands that ran out of time), ``sandbox_faults``, ``f2p_passed``/``p2p_passed`` and
``grade_s``. A sandbox fault (it cannot be created, its supervisor dies) ends the episode with
reward 0 and ``sandbox_fault`` set: it is the machine's fault, counted, never a crash.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from roll_core.envs.base import InvalidAction, Transition
from roll_core.envs.registry import register_env
from roll_core.envs.tool_parsers import ToolCall
from roll_core.envs.tools import Tool, ToolCallingEnv, ToolCallingOptions, ToolSet, tool_call_text
from roll_core.errors import ConfigError, SandboxError
from roll_core.sandbox import LocalBackend, LocalSandbox, SandboxSpec
from roll_core.sandbox.diff import split_diff
from roll_core.swe.grading import grade
from roll_core.swe.task import SweTask, load_tasks

_BACKENDS: dict[int, LocalBackend] = {}
_LOCK = threading.Lock()


def shared_backend(slots: int) -> LocalBackend:
    """One backend per slot count: every env of a process shares its bound on CPU."""
    with _LOCK:
        if slots not in _BACKENDS:
            _BACKENDS[slots] = LocalBackend(max_concurrent=slots)
        return _BACKENDS[slots]


def default_tasks() -> Path:
    """A small task set (24 tasks, seed 0) generated once into the roll cache."""
    from roll_core.swe.generate import generate_swe_tasks

    cache = Path(os.environ.get("ROLL_CACHE_DIR") or Path.home() / ".cache" / "roll")
    target = cache / "swe-tasks" / "seed0-count24"
    with _LOCK:
        if not (target / "manifest.json").is_file():
            staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
            generate_swe_tasks(staging, seed=0, count=24, held_out=0.25)
            staging.rename(target)
    return target


@functools.lru_cache(maxsize=8)
def _cached_tasks(path: str, split: str | None) -> list[SweTask]:
    """Tasks loaded once per process (a rollout builds many envs on the same folder)."""
    return load_tasks(Path(path), split=split)


class SweOptions(ToolCallingOptions):
    """Options of the coding env."""

    max_steps: int = Field(30, ge=1, description="Turns per episode.")
    tasks: str | None = Field(
        None,
        description="Tasks: a `roll data swe` folder, task folders or SWE-bench-style JSONL "
        "(default: 24 tasks generated once into the roll cache).",
    )
    split: Literal["train", "test", "all"] = Field("train", description="Which tasks to draw.")
    time_budget_s: float = Field(600.0, gt=0, description="Wall seconds per episode.")
    command_timeout_s: float = Field(30.0, gt=0, le=600, description="Seconds per bash call.")
    max_output_chars: int = Field(4000, ge=200, description="Characters of a tool's output shown.")
    partial_credit: bool = Field(False, description="Reward the share of fixed tests.")
    grade_on_truncation: bool = Field(True, description="Grade the diff when a budget runs out.")
    isolation: Literal["required", "preferred"] = Field(
        "required", description="Sandbox isolation (docs/swe.md)."
    )
    sandbox_slots: int = Field(
        0, ge=0, description="Sandbox commands at once in this process (0: the CPU count)."
    )
    memory_mb: int = Field(1024, ge=128, description="Address-space limit per process, MiB.")


BASH = {
    "type": "object",
    "properties": {"command": {"type": "string", "description": "A bash command line."}},
    "required": ["command"],
    "additionalProperties": False,
}
EDITOR = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace"]},
        "path": {"type": "string", "description": "Relative to the repository, or /workspace/..."},
        "file_text": {"type": "string", "description": "create: the whole file."},
        "old_str": {"type": "string", "description": "str_replace: text that occurs once."},
        "new_str": {"type": "string", "description": "str_replace: its replacement."},
        "view_range": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "view: [first, last] line (1-based; last -1 = end).",
        },
    },
    "required": ["command", "path"],
    "additionalProperties": False,
}
SUBMIT = {"type": "object", "properties": {}, "additionalProperties": False}


class _EditorError(ValueError):
    """An editor call that cannot be done: its result is ``error: ...`` (a tool error)."""


@register_env
class SweEnv(ToolCallingEnv):
    """Fix the bug an issue describes; see the module docstring."""

    name = "swe"
    Options = SweOptions
    options: SweOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        path = Path(self.options.tasks) if self.options.tasks else default_tasks()
        split = None if self.options.split == "all" else self.options.split
        self.tasks: list[SweTask] = _cached_tasks(str(path.resolve()), split)
        if not self.tasks:
            raise ConfigError(
                f"env swe: no {self.options.split} tasks in {path}.",
                hint="Generate some with `roll data swe DIR` or set split=all.",
            )
        slots = self.options.sandbox_slots or os.cpu_count() or 1
        self.backend = shared_backend(slots)
        self.spec = SandboxSpec(isolation=self.options.isolation, memory_mb=self.options.memory_mb)
        self.box: LocalSandbox | None = None
        self.task: SweTask | None = None
        self.metrics: dict[str, float] = {}
        self._expert: list[dict[str, str]] = []
        self._expert_done = 0
        self._started_at = 0.0

    # ---- tools ------------------------------------------------------------------------------
    def tool_set(self) -> ToolSet:
        return ToolSet(
            [
                Tool("bash", "Run a bash command in the repository.", BASH, self._bash),
                Tool("editor", "View, create or edit a file.", EDITOR, self._editor),
                Tool("submit", "Submit your fix (ends the task).", SUBMIT, lambda: "submitted"),
            ]
        )

    def _sandbox(self) -> LocalSandbox:
        if self.box is None:
            raise SandboxError("the episode's sandbox is closed")
        return self.box

    def _cut(self, text: str) -> str:
        limit = self.options.max_output_chars
        if len(text) <= limit:
            return text
        note = f"\n[output truncated: {len(text)} characters, the first {{}} shown]"
        keep = max(0, limit - len(note) - 8)
        return text[:keep] + note.format(keep)

    def _bash(self, command: str) -> str:
        result = self._sandbox().exec(command, self.options.command_timeout_s)
        self.metrics["timeouts"] += result.timed_out
        status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
        return self._cut(f"[{status}]\n{result.output()}")

    def _editor(self, command: str, path: str, **kw: Any) -> str:
        box = self._sandbox()
        try:
            if command == "view":
                return self._view(box, path, kw.get("view_range"))
            if command == "create":
                box.write_file(path, kw.get("file_text", ""))
                return f"created {path}"
            old, new = kw.get("old_str"), kw.get("new_str", "")
            if old is None:
                raise _EditorError("str_replace needs old_str")
            text = box.read_file(path)
            count = text.count(old)
            if count != 1:
                where = "does not occur" if count == 0 else f"occurs {count} times"
                raise _EditorError(f"old_str {where} in {path}; it must occur exactly once")
            box.write_file(path, text.replace(old, new, 1))
            return f"edited {path}"
        except ValueError as err:
            raise _EditorError(str(err)) from None

    def _view(self, box: LocalSandbox, path: str, view_range: list[int] | None) -> str:
        target = path.removeprefix("/workspace").strip("/") or "."
        if target == "." or (box.workspace / target).is_dir():
            listing = box.exec(f"find {target!r} -maxdepth 2 -not -path '*/.*' | sort", 30)
            return self._cut(listing.stdout)
        lines = box.read_file(path).splitlines()
        first, last = (view_range or [1, -1]) + [-1] * (2 - len(view_range or [1, -1]))
        last = len(lines) if last == -1 else last
        shown = [f"{i:6d}\t{lines[i - 1]}" for i in range(max(1, first), min(last, len(lines)) + 1)]
        return self._cut("\n".join(shown))

    # ---- the episode ------------------------------------------------------------------------
    @property
    def system_prompt(self) -> str:
        return (
            "You are fixing a bug in a Python repository at /workspace. Read the issue, find "
            "the cause with the bash and editor tools, change the code (not the tests), and "
            "call submit when done. Hidden tests check your fix."
        )

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        self._close()
        self.task = self.tasks[int(rng.integers(len(self.tasks)))]
        self.metrics = dict.fromkeys(
            ("solved", "diff_lines", "tool_errors", "timeouts", "sandbox_faults", "grade_s"), 0.0
        )
        self._started_at = time.monotonic()
        self._expert, self._expert_done = expert_calls(self.task), 0
        try:
            self.box = self.backend.create(self.task.repo_dir, self.spec)
        except SandboxError as err:
            self.metrics["sandbox_faults"] = 1.0
            self.box = None
            return f"The sandbox could not be created: {err.message}", {"sandbox_fault": True}
        issue = self.task.problem_statement.strip()
        return f"Issue in the repository at /workspace:\n\n{issue}", {"task_id": self.task.task_id}

    def parse_answer(self, text: str) -> Any:
        raise InvalidAction("no tool call; call bash, editor or submit")

    def on_step(self, action: Any) -> Transition:
        if self.box is None:  # a sandbox fault at reset: nothing to do but end
            return self._finish(0.0, "no sandbox", truncated=False, fault=True)
        kind, calls = action
        submitted = kind == "calls" and any(c.name == "submit" for c in calls)
        if submitted:
            return self._submit()
        try:
            t = super().on_step(action)
        except SandboxError as err:
            return self._finish(0.0, f"sandbox fault: {err.message}", truncated=False, fault=True)
        if not t.info.get("tool_ok", True):
            self.metrics["tool_errors"] += 1
        elif self._expert_done < len(self._expert) and any(
            c.arguments == self._expert[self._expert_done] for c in calls
        ):
            self._expert_done += 1  # the expert's next edit was made
        out_of_time = time.monotonic() - self._started_at > self.options.time_budget_s
        if out_of_time or self.steps >= self.options.max_steps:
            return self._truncate(t, "time" if out_of_time else "steps")
        return t

    def _truncate(self, t: Transition, why: str) -> Transition:
        if not self.options.grade_on_truncation:
            self._close()
            end = self._finish(0.0, f"Out of {why}.", truncated=True)
            end.observation = t.observation
            return end
        end = self._submit(f"Out of {why}: your changes so far are graded. ", truncated=True)
        end.observation = t.observation + "\n" + end.observation
        return end

    def _submit(self, prefix: str = "", truncated: bool = False) -> Transition:
        assert self.task is not None
        try:
            diff = self._sandbox().diff()
        except (SandboxError, OSError) as err:
            return self._finish(0.0, f"sandbox fault: {err}", truncated=truncated, fault=True)
        self._close()
        self.metrics["diff_lines"] = sum(
            line[:1] in "+-" and line[:3] not in ("+++", "---") for line in diff.splitlines()
        )
        try:
            result = grade(self.task, diff, backend=self.backend, spec=self.spec,
                           partial_credit=self.options.partial_credit)  # fmt: skip
        except SandboxError as err:
            return self._finish(0.0, f"grading failed: {err.message}", truncated, fault=True)
        self.metrics["grade_s"] = result.seconds
        self.metrics["solved"] = float(result.resolved)
        self.metrics["f2p_passed"] = float(sum(result.fail_to_pass.values()))
        self.metrics["p2p_passed"] = float(sum(result.pass_to_pass.values()))
        verdict = "solved" if result.resolved else "not solved"
        note = f"{prefix}Submitted: {verdict} (score {result.score:g})."
        if result.dropped:
            note += f" Changes to test files were ignored: {', '.join(result.dropped)}."
        return self._finish(result.score, note, truncated=truncated, success=result.resolved)

    def _finish(
        self,
        reward: float,
        text: str,
        truncated: bool,
        *,
        fault: bool = False,
        success: bool = False,
    ) -> Transition:
        self._close()
        if fault:
            self.metrics["sandbox_faults"] = 1.0
        self.metrics["steps"] = float(self.steps)
        info = {"success": success, "sandbox_fault": fault, "episode_metrics": dict(self.metrics)}
        return Transition(text, reward, not truncated, info, truncated=truncated)

    def _close(self) -> None:
        if self.box is not None:
            self.box.close()
            self.box = None

    def __del__(self) -> None:
        box = getattr(self, "box", None)
        if box is not None:
            box.close()

    def on_tool_result(self, call: ToolCall, output: str, ok: bool) -> None:
        pass

    def render(self) -> str:
        if self.task is None:
            return "swe: no episode"
        return f"swe task {self.task.task_id} (step {self.steps}/{self.options.max_steps})"

    # ---- policies ---------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """The reference fix through editor calls (one ``str_replace`` per hunk), then submit."""
        if self._expert_done >= len(self._expert):
            return tool_call_text("submit", {})
        return tool_call_text("editor", self._expert[self._expert_done])

    def random_action(self, rng: np.random.Generator) -> str:
        choice = int(rng.integers(4))
        if choice == 0:
            return tool_call_text("bash", {"command": "ls -R | head -40"})
        if choice == 1:
            return tool_call_text("bash", {"command": "python -m pytest -q 2>&1 | tail -5"})
        if choice == 2:
            return tool_call_text("editor", {"command": "view", "path": "."})
        return tool_call_text("submit", {})


def expert_calls(task: SweTask) -> list[dict[str, str]]:
    """The reference patch as editor ``str_replace`` arguments, one call per hunk."""
    calls = []
    for path, section in split_diff(task.patch):
        old: list[str] = []
        new: list[str] = []
        in_hunk = False
        for line in section.splitlines():
            if line.startswith("@@"):
                if in_hunk:
                    calls.append(_replace_call(path, old, new))
                old, new, in_hunk = [], [], True
            elif in_hunk and line[:1] in (" ", "-", "+"):
                if line[0] != "+":
                    old.append(line[1:])
                if line[0] != "-":
                    new.append(line[1:])
        if in_hunk:
            calls.append(_replace_call(path, old, new))
    return calls


def _replace_call(path: str, old: list[str], new: list[str]) -> dict[str, str]:
    return {"command": "str_replace", "path": path, "old_str": "\n".join(old),
            "new_str": "\n".join(new)}  # fmt: skip
