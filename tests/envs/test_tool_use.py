"""The tool-use env, its calculator and its sandboxed Python tool."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from roll_core.envs import make_env
from roll_core.envs.base import ToolResult, observation_tool_results
from roll_core.envs.sandbox import calculate, run_python
from roll_core.errors import ConfigError


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2^10", "1024"),  # ^ is power
        ("(3 + 4) * 5", "35"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),  # 2.0 shown as 2
        ("17 // 5 + 17 % 5", "5"),  # 3 + 2
        ("-sqrt(16) + abs(-3)", "-1"),  # -4 + 3
        ("1,000 + 2", "1002"),
        ("12 × 3 ÷ 4", "9"),
    ],
)
def test_calculator(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("10 ** 10 ** 10", "power too large"),
        ("__import__('os').system('true')", "is not allowed"),
        ("(1).real", "is not allowed"),
        ("1 / 0", "division by zero"),
        ("2 +", "cannot parse"),
        ("", "empty expression"),
    ],
)
def test_calculator_refuses(expression: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        calculate(expression)


def test_python_tool_runs_in_a_separate_limited_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_TEST_SECRET", "do-not-leak")
    result = run_python(
        "import os, resource\n"
        "print(os.getpid())\n"
        "print('ROLL_TEST_SECRET' in os.environ)\n"
        "print(resource.getrlimit(resource.RLIMIT_AS)[1] // 2**20)\n"
        "print(sum(range(10)))",
        memory_mb=300,
    )
    assert result.ok and not result.timed_out
    pid, leaked, mem, total = result.output.split()
    assert int(pid) != os.getpid()
    assert leaked == "False"
    assert mem == "300"  # the hard limit the child set on itself
    assert total == "45"


def test_python_tool_limits() -> None:
    start = time.monotonic()
    spin = run_python("while True:\n    pass", timeout=1.0)
    assert spin.timed_out and not spin.ok and spin.exit_code is None
    assert time.monotonic() - start < 10
    assert "time limit" in spin.describe()

    hog = run_python("x = bytearray(4 * 1024**3)", memory_mb=256)
    assert not hog.ok and "MemoryError" in hog.output

    crash = run_python("1 / 0")
    assert crash.exit_code == 1 and crash.output.rstrip().endswith(
        "ZeroDivisionError: division by zero"
    )
    assert 'File "main.py", line 1' in crash.output and "<string>" not in crash.output

    flood = run_python("print('x' * 100_000)", max_output=300)
    assert flood.truncated and len(flood.output) <= 300 + len("\n...\n")


def _arith_env(**options: object):
    env = make_env("tool_use", task="arithmetic", **options)
    obs, info = env.reset(11)
    match = re.fullmatch(r"Problem: Compute (.+)\.", obs)
    assert match, obs
    assert info["tools"] == options.get("tools", ["calculator", "python"])
    return env, match.group(1)


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_tool_calls_then_a_correct_answer() -> None:
    env, expression = _arith_env()
    value = calculate(expression)  # the problem's own expression, evaluated independently
    obs, reward, terminated, _, info = env.step(
        "Let me compute. " + call("calculator", expression=expression)
    )
    assert observation_tool_results(obs) == (ToolResult("calculator", value),)
    assert obs == f"[calculator] {value}"
    assert (reward, terminated, info["tools"], info["tool_ok"]) == (
        0.0,
        False,
        ["calculator"],
        True,
    )

    obs, _, _, _, info = env.step(call("python", code=f"print({expression})"))
    assert observation_tool_results(obs) == (ToolResult("python", value),)
    assert info["tools"] == ["python"]

    obs, reward, terminated, truncated, info = env.step(f"The answer is <answer>{value}</answer>")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert obs == f"Your answer {value} is correct." and not observation_tool_results(obs)
    assert info["step"] == 3


def test_two_calls_in_one_turn_give_two_tool_messages() -> None:
    env, _ = _arith_env()
    obs = env.step(
        call("calculator", expression="6 * 7") + "\n" + call("python", code="print(1/0)")
    ).observation
    first, second = observation_tool_results(obs)
    assert first == ToolResult("calculator", "42")
    assert second.name == "python" and second.content.startswith("error: Traceback")
    assert "ZeroDivisionError: division by zero" in second.content


def test_wrong_answer_invalid_actions_and_disabled_tools() -> None:
    env, expression = _arith_env(tools=["calculator"], tool_reward=-0.05)
    value = int(calculate(expression))
    _, reward, terminated, _, info = env.step(call("python", code="print(1)"))
    assert not info["action_is_valid"]
    assert info["invalid_reason"] == (
        "the tool call names the tool 'python', which does not exist (tools: calculator)"
    )
    assert (reward, terminated) == (-0.1, False)
    _, reward, _, _, info = env.step("I am not sure")
    assert not info["action_is_valid"] and reward == -0.1
    assert info["invalid_reason"] == "no tool call and no final answer <answer>NUMBER</answer>"
    _, reward, _, _, info = env.step(call("calculator", expression="2 +"))
    assert info["action_is_valid"] and not info["tool_ok"] and reward == -0.05
    obs, reward, terminated, _, info = env.step(f"<answer>{value + 1}</answer>")
    assert (reward, terminated, info["success"]) == (0.0, True, False)
    assert obs == f"Your answer {value + 1} is wrong; the answer is {value}."


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>',
            "the tool call is not valid JSON (Expecting ',' delimiter at character 57)",
        ),
        (
            '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>',
            "the tool call names the tool 'calc', which does not exist (tools: calculator, python)",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>',
            "the tool call (calculator): the arguments do not match its schema: "
            "expression: 12 is not of type 'string'",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
            "the tool call (calculator): the arguments do not match its schema: "
            "'expression' is a required property",
        ),
    ],
)
def test_malformed_calls_are_invalid_actions_that_say_what_is_wrong(
    response: str, reason: str
) -> None:
    env, _ = _arith_env()
    result = env.step(response)
    assert not result.info["action_is_valid"]
    assert result.info["invalid_reason"].startswith(reason)
    assert result.observation.startswith(f"Invalid action: {reason}")
    assert not observation_tool_results(result.observation)


def test_bare_number_is_an_answer_and_max_steps_truncates() -> None:
    env, expression = _arith_env(max_steps=2)
    env.step(call("calculator", expression="1 + 1"))
    _, _, terminated, truncated, _ = env.step(call("calculator", expression="2 + 2"))
    assert truncated and not terminated
    env, expression = _arith_env()
    assert env.step(f"{calculate(expression)}.").info["success"]


def test_the_xml_tag_format_is_gone_with_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="XML-tag format .* was removed"):
        make_env("tool_use", tool_parser="xml")
    env, _ = _arith_env()
    assert not env.step("<calculator>1 + 1</calculator>").info["action_is_valid"]


def test_the_tools_are_openai_function_schemas() -> None:
    tools = make_env("tool_use", tools=["calculator"]).tools
    assert [t["function"]["name"] for t in tools] == ["calculator"]
    assert tools[0]["type"] == "function"
    assert tools[0]["function"]["parameters"]["required"] == ["expression"]


def test_word_problems_state_their_answers() -> None:
    env = make_env("tool_use", task="word")
    kinds = set()
    for seed in range(40):
        question = env.reset(seed)[0]
        n = [int(x) for x in re.findall(r"\d+", question)]
        if "boxes of" in question:  # n boxes of k items, gives away g: n * k - g
            kinds.add("boxes")
            expected = n[0] * n[1] - n[2]
        elif "km/h" in question:  # h1 hours at v1, then h2 hours at v2
            kinds.add("train")
            expected = n[0] * n[1] + n[2] * n[3]
        elif "consecutive" in question:  # m numbers from s: m * s + m (m - 1) / 2
            kinds.add("sum")
            expected = n[0] * n[1] + n[0] * (n[0] - 1) // 2
        else:  # k dollars a week for n weeks, spends g
            kinds.add("savings")
            expected = n[0] * n[1] - n[2]
        assert env.step(f"<answer>{expected}</answer>").info["success"], question
    assert kinds == {"boxes", "train", "sum", "savings"}
    # a seed gives the same problem in a fresh env; seeds give different problems
    assert make_env("tool_use").reset(5) == make_env("tool_use").reset(5)
    assert len({make_env("tool_use").reset(s)[0] for s in range(20)}) == 20


def test_problems_file(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"question": "What is 6 times 7?", "answer": 42}) + "\n")
    env = make_env("tool_use", problems=str(path))
    assert env.reset(0)[0] == "Problem: What is 6 times 7?"
    assert env.step("<answer>42.0</answer>").reward == 1.0

    path.write_text('{"question": "no answer"}\n')
    with pytest.raises(ConfigError, match="line 1: expected a JSON object with 'question'"):
        make_env("tool_use", problems=str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        make_env("tool_use", problems=str(tmp_path / "missing.jsonl"))
