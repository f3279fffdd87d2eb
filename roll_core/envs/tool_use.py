"""Tool use: answer an arithmetic or word problem, calling a calculator or Python on the way.

The tools are native (see :mod:`roll_core.envs.tools`): declared as JSON schemas that the
model's chat template renders (``tools=``), called in the model's own format (``tool_parser``,
default ``hermes``, Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), their
results sent back as ``tool`` messages. Each turn the model either calls tools or answers:

* ``calculator(expression)``: arithmetic (see :func:`~roll_core.envs.sandbox.calculate`);
* ``python(code)``: a program run in a separate, time- and resource-limited Python process (see
  :func:`~roll_core.envs.sandbox.run_python`), never in the env's process; the result is what
  it prints;
* ``<answer>8124</answer>`` (or a bare number), no tool call: the final answer, which ends the
  episode.

The reward is on the final answer only: ``correct_reward`` when its number equals the solution
(relative tolerance 1e-6), ``wrong_reward`` otherwise; a turn with tool calls earns
``tool_reward`` (0 by default). A malformed call (not JSON, an unknown tool, arguments that do
not match the schema) or a response with neither a call nor a number is an invalid action.
Problems are generated from the seed, or drawn from a JSONL file (``problems``, rows
``{"question": ..., "answer": <number>}``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from roll_core.envs.base import InvalidAction, Transition, extract_answer
from roll_core.envs.registry import register_env
from roll_core.envs.sandbox import calculate, format_number, run_python
from roll_core.envs.tool_parsers import ToolCall
from roll_core.envs.tools import Tool, ToolCallingEnv, ToolCallingOptions, ToolSet, tool_call_text

ToolName = Literal["calculator", "python"]
TOOLS: tuple[ToolName, ...] = ("calculator", "python")
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_FENCE_RE = re.compile(r"^```(?:python|py)?\s*\n?(.*?)\n?```$", re.DOTALL)
_NAMES = ("Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Julia")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "stamps")


def make_problem(rng: np.random.Generator, kind: str) -> tuple[str, float]:
    """A generated problem of ``kind`` (``arithmetic`` or ``word``) and its numeric answer."""
    if kind == "arithmetic":
        a, b, c = (int(x) for x in rng.integers(10, 1000, size=3))
        d = int(rng.integers(2, 100))
        forms = [
            (f"({a} * {d}) - {b}", a * d - b),
            (f"{a} + {b} * {d}", a + b * d),
            (f"({a} + {b}) * {d} - {c}", (a + b) * d - c),
            (f"{a} * {b} - {c} * {d}", a * b - c * d),
        ]
        text, value = forms[int(rng.integers(len(forms)))]
        return f"Compute {text}.", float(value)
    name = _NAMES[int(rng.integers(len(_NAMES)))]
    item = _ITEMS[int(rng.integers(len(_ITEMS)))]
    n, k = int(rng.integers(3, 30)), int(rng.integers(6, 50))
    give, start = int(rng.integers(1, n * k)), int(rng.integers(1, 100))
    speed1, hours1 = int(rng.integers(40, 130)), int(rng.integers(2, 9))
    speed2, hours2 = int(rng.integers(40, 130)), int(rng.integers(2, 9))
    templates = [
        (
            f"{name} buys {n} boxes of {item} with {k} {item} in each box and gives away {give}. "
            f"How many {item} does {name} have left?",
            n * k - give,
        ),
        (
            f"A train runs {hours1} hours at {speed1} km/h, then {hours2} hours at {speed2} km/h. "
            "How many kilometres does it travel in total?",
            speed1 * hours1 + speed2 * hours2,
        ),
        (
            f"What is the sum of the {n * 4} consecutive whole numbers starting at {start}?",
            sum(range(start, start + n * 4)),
        ),
        (
            f"{name} saves {k} dollars a week for {n} weeks, then spends {give} dollars. "
            "How many dollars are left?",
            k * n - give,
        ),
    ]
    text, value = templates[int(rng.integers(len(templates)))]
    return text, float(value)


def load_problems(path: str) -> list[tuple[str, float]]:
    """Rows of a JSONL problems file as ``(question, answer)``; ValueError if malformed."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"problems file {p} does not exist")
    rows = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((str(row["question"]), float(row["answer"])))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"problems file {p}, line {i}: expected a JSON object with 'question' and a "
                f"numeric 'answer' ({type(err).__name__}: {err})"
            ) from None
    if not rows:
        raise ValueError(f"problems file {p} has no rows")
    return rows


class ToolUseOptions(ToolCallingOptions):
    """Options of the tool-use env."""

    max_steps: int = Field(5, ge=1, description="Turns (tool calls and the answer) per episode.")
    task: Literal["arithmetic", "word", "mixed"] = Field(
        "mixed", description="Kind of generated problem (mixed: either, by the seed)."
    )
    problems: str | None = Field(
        None, description="A JSONL file of {question, answer} rows to draw from instead."
    )
    tools: list[ToolName] = Field(
        default_factory=lambda: list(TOOLS),
        description="The tools the model may call.",
    )
    correct_reward: float = Field(1.0, description="Reward for a correct final answer.")
    wrong_reward: float = Field(0.0, description="Reward for a wrong final answer.")
    python_timeout: float = Field(
        5.0, gt=0.0, le=120.0, description="Wall-clock seconds a Python tool call may run."
    )
    python_memory_mb: int = Field(512, ge=64, description="Address-space limit of a Python call.")

    @field_validator("problems")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value is not None:
            load_problems(value)
        return value


CALCULATOR_SCHEMA = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": "Arithmetic: numbers, + - * / // % ** ^, parentheses, abs round "
            "min max sqrt. Example: 12 * (3 + 4)",
        }
    },
    "required": ["expression"],
    "additionalProperties": False,
}
PYTHON_SCHEMA = {
    "type": "object",
    "properties": {
        "code": {
            "type": "string",
            "description": "A Python program; its printed output is the result.",
        }
    },
    "required": ["code"],
    "additionalProperties": False,
}


@register_env
class ToolUseEnv(ToolCallingEnv):
    """Problems answered with the help of a calculator and a sandboxed Python tool."""

    name = "tool_use"
    Options = ToolUseOptions
    options: ToolUseOptions

    question: str
    answer: float
    history: list[str]

    def tool_set(self) -> ToolSet:
        o = self.options
        tools = []
        if "calculator" in o.tools:
            tools.append(
                Tool(
                    "calculator", "Evaluate an arithmetic expression.", CALCULATOR_SCHEMA, calculate
                )
            )
        if "python" in o.tools:
            tools.append(
                Tool(
                    "python",
                    "Run a Python program and show what it prints.",
                    PYTHON_SCHEMA,
                    self._python,
                )
            )
        return ToolSet(tools)

    def _python(self, code: str) -> str:
        fenced = _FENCE_RE.match(code.strip())
        o = self.options
        result = run_python(
            fenced.group(1) if fenced else code,
            timeout=o.python_timeout,
            memory_mb=o.python_memory_mb,
            max_output=o.max_output_chars,
        )
        if not result.ok:
            raise ValueError(result.describe())
        return result.describe()

    @property
    def system_prompt(self) -> str:
        return (
            "Solve the problem. You may call the tools before answering. When you know the "
            "result, reply with <answer>NUMBER</answer> and no tool call; that ends the task."
        )

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        o = self.options
        if o.problems is not None:
            rows = load_problems(o.problems)
            self.question, self.answer = rows[int(rng.integers(len(rows)))]
        else:
            kind = o.task if o.task != "mixed" else ("arithmetic", "word")[int(rng.integers(2))]
            self.question, self.answer = make_problem(rng, kind)
        self.history = []
        return f"Problem: {self.question}", {"tools": list(o.tools)}

    def parse_answer(self, text: str) -> str:
        body = extract_answer(text).replace(",", "")
        if "<answer>" not in text.lower():
            bare = body.strip().rstrip(".")
            if not _NUMBER_RE.fullmatch(bare):
                raise InvalidAction("no tool call and no final answer <answer>NUMBER</answer>")
            return bare
        numbers = _NUMBER_RE.findall(body)
        if not numbers:
            raise InvalidAction(f"the answer {body[:40]!r} holds no number")
        return str(numbers[-1])

    def on_answer(self, answer: str) -> Transition:
        given = float(answer)
        correct = abs(given - self.answer) <= 1e-6 * max(1.0, abs(self.answer))
        verdict = "correct" if correct else f"wrong; the answer is {format_number(self.answer)}"
        self.history.append(f"answer {answer}")
        reward = self.options.correct_reward if correct else self.options.wrong_reward
        info: dict[str, Any] = {"tool": None, "answer": given, "success": correct}
        return Transition(f"Your answer {answer} is {verdict}.", reward, True, info)

    def on_tool_result(self, call: ToolCall, output: str, ok: bool) -> None:
        shown = next(iter(call.arguments.values()), "") if call.arguments else ""
        self.history.append(f"{call.name}: {str(shown)[:60]} -> {output[:60]}")

    def action_hint(self) -> str:
        return (
            super().action_hint().replace("final answer.", "final answer <answer>NUMBER</answer>.")
        )

    def render(self) -> str:
        lines = [f"Problem: {self.question}"]
        lines += [f"  {i}. {h}" for i, h in enumerate(self.history, start=1)]
        return "\n".join(lines)

    def random_action(self, rng: np.random.Generator) -> str:
        numbers = _NUMBER_RE.findall(self.question) or ["1", "2"]
        a, b = (numbers[int(i)] for i in rng.integers(len(numbers), size=2))
        op = "+-*"[int(rng.integers(3))]
        choice = int(rng.integers(3))
        if choice == 0 and "calculator" in self.options.tools:
            return tool_call_text("calculator", {"expression": f"{a} {op} {b}"})
        if choice == 1 and "python" in self.options.tools:
            return tool_call_text("python", {"code": f"print({a} {op} {b})"})
        return f"<answer>{int(rng.integers(0, 1000))}</answer>"
