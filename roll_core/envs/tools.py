"""Native tool calling for envs: tools declared as JSON schemas, calls read by a named parser.

A :class:`Tool` is a name, a description, the JSON Schema of its arguments and the function
that runs it. Its :meth:`Tool.schema` is the OpenAI function format, which the env returns from
:attr:`TextEnv.tools <roll_core.envs.base.TextEnv.tools>` and the chat template renders
(``tools=``). :class:`ToolCallingEnv` is the base of an env whose model calls tools in its own
format (``tool_parser``, default ``hermes``: see :mod:`roll_core.envs.tool_parsers`)::

    class Lookup(ToolCallingEnv):
        name = "lookup"

        def tool_set(self):
            return ToolSet([Tool("capital", "The capital of a country.",
                                 {"type": "object",
                                  "properties": {"country": {"type": "string"}},
                                  "required": ["country"]},
                                 run=lambda country: CAPITALS.get(country, "unknown"))])

        def on_reset(self, rng):
            self.country = ...
            return f"What is the capital of {self.country}?", {}

        def parse_answer(self, text):           # a response without a tool call
            return extract_answer(text)

        def on_answer(self, answer):            # -> Transition (usually terminated)
            ok = answer == CAPITALS[self.country]
            return Transition("Correct." if ok else "Wrong.", float(ok), True, {"success": ok})

A response with calls runs every call (in order) and the next observation carries one
:class:`~roll_core.envs.base.ToolResult` per call (``tool`` messages). A malformed call (not
JSON, an unknown tool, arguments that do not match the schema) is an invalid action whose
reason names the call and what is wrong; no call of that response runs.

Schemas are checked when the env is built (and by ``roll validate``): with the ``jsonschema``
package (:data:`SCHEMA_VALIDATOR` ``"jsonschema"``; a dependency of roll's Ray install) when it
imports, else with a minimal checker (``"minimal"``: the OpenAI function shape, an object schema,
known JSON types, ``required`` naming declared properties; arguments checked for required and
unknown keys and the JSON type of each declared property).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from roll_core.envs.base import (
    EnvOptions,
    InvalidAction,
    Observation,
    TextEnv,
    ToolResult,
    Transition,
)
from roll_core.envs.tool_parsers import ParsedResponse, ToolCall, get_tool_parser
from roll_core.errors import ConfigError

try:  # pragma: no cover - which branch runs depends on the install
    import jsonschema as _jsonschema

    SCHEMA_VALIDATOR = "jsonschema"
except ImportError:  # pragma: no cover
    _jsonschema = None
    SCHEMA_VALIDATOR = "minimal"
"""Which checker validates tool schemas and arguments: ``jsonschema`` or ``minimal``."""

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: ``run(**arguments) -> str`` (raise ValueError for an error
    the model should see as the tool's output)."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # the JSON Schema of the arguments object
    run: Callable[..., str]

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-format schema the chat template renders."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


def schema_problems(schema: Any) -> list[str]:
    """What is wrong with one tool schema in the OpenAI function format (``[]``: nothing)."""
    if not isinstance(schema, Mapping):
        return [f"a tool schema must be a mapping, got {type(schema).__name__}"]
    fn = schema.get("function")
    if schema.get("type") != "function" or not isinstance(fn, Mapping):
        return [
            'a tool schema is {"type": "function", "function": {name, description, parameters}}'
        ]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        return [f"function.name {name!r} must be 1-64 letters, digits, '_' or '-'"]
    problems = []
    if not isinstance(fn.get("description", ""), str):
        problems.append(f"{name}: function.description must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type") != "object":
        return [
            *problems,
            f'{name}: function.parameters must be a JSON Schema with "type": "object"',
        ]
    if _jsonschema is not None:
        try:
            _jsonschema.Draft202012Validator.check_schema(dict(params))
        except _jsonschema.SchemaError as err:
            where = "/".join(str(p) for p in err.path) or "parameters"
            problems.append(
                f"{name}: function.parameters is not valid JSON Schema ({where}: {err.message})"
            )
        return problems
    props = params.get("properties", {})
    if not isinstance(props, Mapping):
        return [*problems, f"{name}: parameters.properties must be an object"]
    for key, prop in props.items():
        ptype = prop.get("type") if isinstance(prop, Mapping) else None
        types = ptype if isinstance(ptype, list) else [ptype]
        if not isinstance(prop, Mapping) or any(t not in _JSON_TYPES for t in types if t):
            problems.append(f"{name}: parameters.properties.{key} has an unknown type {ptype!r}")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        problems.append(f"{name}: parameters.required {required!r} must list declared properties")
    return problems


def argument_problem(parameters: Mapping[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not match the ``parameters`` schema (None: they do)."""
    if _jsonschema is not None:
        validator = _jsonschema.Draft202012Validator(dict(parameters))
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
        if not errors:
            return None
        err = errors[0]
        where = ".".join(str(p) for p in err.path)
        return f"{where}: {err.message}" if where else err.message
    props = parameters.get("properties", {})
    for key in parameters.get("required", []):
        if key not in arguments:
            return f"{key!r} is a required property"
    for key, value in arguments.items():
        if key not in props:
            if parameters.get("additionalProperties", True) is False:
                return f"unexpected argument {key!r} (declared: {', '.join(props) or 'none'})"
            continue
        ptype = props[key].get("type")
        types = ptype if isinstance(ptype, list) else [ptype] if ptype else []
        ok = not types or any(
            isinstance(value, _JSON_TYPES[t])
            and not (t in ("integer", "number") and isinstance(value, bool))
            for t in types
        )
        if not ok:
            return f"{key}: {json.dumps(value)} is not of type {ptype!r}"
    return None


class ToolSet:
    """The tools of one env by name: their schemas, checking calls, running them."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.by_name = {t.name: t for t in tools}
        if len(self.by_name) != len(tools):
            raise ValueError("two tools share a name")
        for tool in tools:
            problems = schema_problems(tool.schema())
            if problems:
                raise ConfigError(
                    f"tool {tool.name!r} has an invalid schema: {'; '.join(problems)} "
                    f"(checked with {SCHEMA_VALIDATOR}).",
                    hint="Declare the arguments as a JSON Schema object: "
                    '{"type": "object", "properties": {...}, "required": [...]}.',
                )

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.by_name.values()]

    def check(self, call: ToolCall, where: str) -> str | None:
        """Why ``call`` cannot run (None: it can): an unknown tool or mismatching arguments."""
        tool = self.by_name.get(call.name)
        if tool is None:
            return (
                f"{where} names the tool {call.name!r}, which does not exist "
                f"(tools: {', '.join(self.by_name) or 'none'})"
            )
        problem = argument_problem(tool.parameters, call.arguments)
        if problem:
            return f"{where} ({call.name}): the arguments do not match its schema: {problem}"
        return None

    def run(self, call: ToolCall) -> tuple[str, bool]:
        """The tool's output and whether it succeeded (a ValueError becomes ``error: ...``)."""
        try:
            return str(self.by_name[call.name].run(**call.arguments)), True
        except ValueError as err:
            return f"error: {err}", False


class ToolCallingOptions(EnvOptions):
    """Options every tool-calling env takes."""

    tool_parser: str = Field(
        "hermes",
        description="How the model's tool calls are read (hermes: Qwen2.5/Qwen3 "
        "<tool_call>{json}</tool_call>).",
    )
    max_calls_per_turn: int = Field(4, ge=1, description="Tool calls one response may make.")
    tool_reward: float = Field(0.0, description="Reward of each turn that calls tools.")
    max_output_chars: int = Field(800, ge=50, description="Characters of tool output shown.")


class ToolCallingEnv(TextEnv):
    """Base of an env whose model calls tools natively; see the module docstring."""

    Options: ClassVar[type[EnvOptions]] = ToolCallingOptions
    options: ToolCallingOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        get_tool_parser(self.options.tool_parser)  # a typo fails when the env is built
        self._tools = self.tool_set()

    # ---- what subclasses implement ------------------------------------------------------------
    def tool_set(self) -> ToolSet:
        raise NotImplementedError(f"{type(self).__name__} must define tool_set()")

    def parse_answer(self, text: str) -> Any:
        """Read the final answer from a response without tool calls (InvalidAction if none)."""
        raise NotImplementedError(f"{type(self).__name__} must define parse_answer()")

    def on_answer(self, answer: Any) -> Transition:
        raise NotImplementedError(f"{type(self).__name__} must define on_answer()")

    # ---- the protocol -------------------------------------------------------------------------
    @property
    def tools(self) -> list[dict[str, Any]]:
        return self._tools.schemas()

    def parse_response(self, text: str) -> ParsedResponse:
        return get_tool_parser(self.options.tool_parser)(text)

    def parse_action(self, text: str) -> Any:
        parsed = self.parse_response(text)
        if not parsed.has_calls:
            return ("answer", self.parse_answer(parsed.content))
        if parsed.errors:
            raise InvalidAction("; ".join(parsed.errors))
        calls = parsed.calls
        if len(calls) > self.options.max_calls_per_turn:
            raise InvalidAction(
                f"{len(calls)} tool calls in one turn; at most {self.options.max_calls_per_turn}"
            )
        for k, call in enumerate(calls, start=1):
            problem = self._tools.check(
                call, f"tool call {k}" if len(calls) > 1 else "the tool call"
            )
            if problem:
                raise InvalidAction(problem)
        return ("calls", calls)

    def on_step(self, action: Any) -> Transition:
        kind, value = action
        if kind == "answer":
            return self.on_answer(value)
        results, oks = [], []
        for call in value:
            output, ok = self._tools.run(call)
            output = output[: self.options.max_output_chars]
            results.append(ToolResult(call.name, output, call.call_id))
            oks.append(ok)
            self.on_tool_result(call, output, ok)
        text = "\n".join(f"[{r.name}] {r.content}" for r in results)
        info = {"tools": [c.name for c in value], "tool_ok": all(oks), "success": False}
        return Transition(
            Observation(text, tool_results=results), self.options.tool_reward, False, info
        )

    def on_tool_result(self, call: ToolCall, output: str, ok: bool) -> None:
        """Hook: a call ran (e.g. to keep a history for :meth:`render`)."""

    def action_hint(self) -> str:
        names = ", ".join(self._tools.by_name)
        return (
            f'Call a tool ({names}) as <tool_call>{{"name": ..., "arguments": {{...}}}}'
            "</tool_call>, or give your final answer."
        )


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A hermes call as a model writes it (for random and human policies, tests, docs)."""
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": dict(arguments)})
        + "\n</tool_call>"
    )
