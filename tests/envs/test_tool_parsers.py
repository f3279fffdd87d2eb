"""The hermes tool-call parser and the tool checks, on hand-written responses."""

from __future__ import annotations

import pytest

from roll_core.envs.tool_parsers import ToolCall, get_tool_parser, parse_hermes, tool_parsers
from roll_core.envs.tools import SCHEMA_VALIDATOR, Tool, ToolSet, argument_problem, schema_problems
from roll_core.errors import ConfigError

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = ToolSet([Tool("add", "Add two integers.", ADD, run=lambda a, b: str(a + b))])


def test_one_good_call_and_the_text_around_it() -> None:
    parsed = parse_hermes(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    assert parsed.calls == (ToolCall("add", {"a": 2, "b": 3}),)
    assert parsed.content == "Let me add." and parsed.errors == ()
    assert TOOLS.check(parsed.calls[0], "the tool call") is None
    assert TOOLS.run(parsed.calls[0]) == ("5", True)


def test_several_calls_arguments_as_a_string_and_reasoning_skipped() -> None:
    parsed = parse_hermes(
        "<think>maybe <tool_call>{bad}</tool_call></think>\n\n"
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}</tool_call>'
    )
    assert parsed.calls == (ToolCall("add", {"a": 1, "b": 1}), ToolCall("add", {"a": 4, "b": 5}))
    assert parsed.errors == () and parsed.content == ""


def test_no_call_is_content_only() -> None:
    parsed = parse_hermes("<think>hmm</think>\n\nThe answer is 5.")
    assert not parsed.has_calls and parsed.content == "The answer is 5."


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
            "the tool call is not valid JSON (Expecting property name enclosed in double quotes "
            'at character 37): {"name": "add", "arguments": {"a": 1,}}',
        ),
        ("<tool_call>[1, 2]</tool_call>", "the tool call is a JSON list, not an object: [1, 2]"),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            'the tool call has no "name" (a string): {"arguments": {}}',
        ),
        (
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            'the tool call (add): "arguments" must be a JSON object, got [1, 2]',
        ),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1',
            "the tool call is not closed with </tool_call> (cut off?)",
        ),
    ],
)
def test_unreadable_calls_say_what_is_wrong(text: str, error: str) -> None:
    parsed = parse_hermes(text)
    assert parsed.calls == () and parsed.errors == (error,) and parsed.has_calls


def test_second_of_two_calls_is_named() -> None:
    parsed = parse_hermes(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
    )
    assert len(parsed.calls) == 1
    assert parsed.errors[0].startswith("tool call 2 is not valid JSON")


def test_unknown_tool_and_schema_mismatch() -> None:
    assert TOOLS.check(ToolCall("sub", {"a": 1}), "the tool call") == (
        "the tool call names the tool 'sub', which does not exist (tools: add)"
    )
    assert TOOLS.check(ToolCall("add", {"a": 1, "b": "2"}), "tool call 2") == (
        "tool call 2 (add): the arguments do not match its schema: b: '2' is not of type 'integer'"
    )
    assert argument_problem(ADD, {"a": 1, "b": 2, "c": 3}) is not None  # additionalProperties
    assert argument_problem(ADD, {"a": 1, "b": 2}) is None


def test_schema_problems() -> None:
    good = Tool("add", "Add.", ADD, run=str).schema()
    assert schema_problems(good) == []
    assert schema_problems({"name": "add"}) == [
        'a tool schema is {"type": "function", "function": {name, description, parameters}}'
    ]
    bad_name = {"type": "function", "function": {"name": "add numbers"}}
    assert "must be 1-64 letters" in schema_problems(bad_name)[0]
    not_object = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    assert schema_problems(not_object) == [
        'f: function.parameters must be a JSON Schema with "type": "object"'
    ]
    bad_type = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integr"}}},
        },
    }
    assert SCHEMA_VALIDATOR == "jsonschema"  # installed with roll's dependencies (ray)
    assert "is not valid JSON Schema" in schema_problems(bad_type)[0]
    with pytest.raises(ConfigError, match="tool 'f' has an invalid schema"):
        ToolSet([Tool("f", "x", {"type": "object", "properties": {"x": {"type": "integr"}}}, str)])


def test_parser_registry_names_the_valid_parsers() -> None:
    assert "hermes" in tool_parsers() and get_tool_parser("hermes") is parse_hermes
    with pytest.raises(ConfigError, match="Did you mean 'hermes'") as err:
        get_tool_parser("hermse")
    assert "Registered parsers: hermes" in err.value.message
