"""Read the model's native tool calls out of its response text: a small registry of parsers.

A parser turns the decoded response into :class:`ParsedResponse`: the text outside the calls
(``content``), the calls it could read (:class:`ToolCall`) and, for every call it could not
read, one error sentence (``errors``) saying exactly what is wrong, which the env shows the
model as an invalid action. Parsers only read the format; checking a call against the declared
tools (unknown name, arguments that do not match the schema) is
:meth:`roll_core.envs.tools.ToolSet.check`'s.

``hermes`` (the default) is the format of Qwen2.5 / Qwen3 and every Hermes-style template::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

one JSON object per ``<tool_call>`` block, several blocks for several calls. A reasoning block
(``<think>...</think>``) is skipped: a call written while thinking is not a call. Add a parser
with :func:`register_tool_parser`; :func:`get_tool_parser` names the valid ones on a typo.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from roll_core.errors import ConfigError


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's ``name`` and its ``arguments`` (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    call_id: str | None = None

    def openai(self) -> dict[str, Any]:
        """The call in an assistant message's ``tool_calls`` (OpenAI's shape)."""
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if self.call_id is not None:
            call["id"] = self.call_id
        return call


@dataclass(frozen=True)
class ParsedResponse:
    """What a parser read from one response."""

    content: str  # the response without its tool-call blocks (and reasoning), stripped
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = field(default_factory=tuple)  # one sentence per unreadable call

    @property
    def has_calls(self) -> bool:
        """Whether the response tried to call a tool (readable or not)."""
        return bool(self.calls or self.errors)


ToolParser = Callable[[str], ParsedResponse]
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    """Decorator: register ``fn(text) -> ParsedResponse`` as the tool-call parser ``name``."""

    def wrap(fn: ToolParser) -> ToolParser:
        if name in _PARSERS and _PARSERS[name] is not fn:
            raise ValueError(f"tool parser {name!r} is already registered")
        _PARSERS[name] = fn
        return fn

    return wrap


def tool_parsers() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; a ConfigError listing the valid names otherwise."""
    if name in _PARSERS:
        return _PARSERS[name]
    close = difflib.get_close_matches(name, list(_PARSERS), n=1)
    extra = ""
    if name.lower() in ("xml", "tags", "xml_tags"):
        extra = (
            " The XML-tag format (<calculator>...</calculator>, <python>...</python>) was "
            "removed: tools are called in the model's own format through its chat template."
        )
    raise ConfigError(
        f"unknown tool parser '{name}'."
        + (f" Did you mean '{close[0]}'?" if close else "")
        + f" Registered parsers: {', '.join(tool_parsers())}.{extra}",
        hint="Use tool_parser: hermes (Qwen2.5, Qwen3 and other Hermes-style templates: "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>), or register a parser with '
        "roll_core.envs.tool_parsers.register_tool_parser.",
    )


_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """``text`` without ``<think>...</think>`` blocks (and without an unclosed one's text)."""
    text = _THINK_RE.sub("", text)
    if "</think>" in text:  # the template wrote <think> into the prompt: only the close is here
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:  # opened and never closed: the budget ran out while reasoning
        text = text.split("<think>", 1)[0]
    return text


@register_tool_parser("hermes")
def parse_hermes(text: str) -> ParsedResponse:
    """Hermes / Qwen calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    body = strip_reasoning(text)
    calls: list[ToolCall] = []
    errors: list[str] = []
    matches = list(_CALL_RE.finditer(body))
    for k, found in enumerate(matches, start=1):
        where = f"tool call {k}" if len(matches) > 1 else "the tool call"
        raw, closed = found.group(1).strip(), bool(found.group(2))
        if not closed:
            errors.append(f"{where} is not closed with </tool_call> (cut off?)")
            continue
        call, error = _read_call(raw, where)
        if error:
            errors.append(error)
        elif call is not None:
            calls.append(call)
    content = _CALL_RE.sub("", body).strip()
    return ParsedResponse(content, tuple(calls), tuple(errors))


def _read_call(raw: str, where: str) -> tuple[ToolCall | None, str | None]:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        return None, f"{where} is not valid JSON ({err.msg} at character {err.pos}): {_cut(raw)}"
    if not isinstance(data, dict):
        return None, f"{where} is a JSON {type(data).__name__}, not an object: {_cut(raw)}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, f'{where} has no "name" (a string): {_cut(raw)}'
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            return None, f'{where} ({name}): "arguments" is a string that is not JSON ({err.msg})'
    if not isinstance(args, dict):
        return (
            None,
            f'{where} ({name}): "arguments" must be a JSON object, got {_cut(json.dumps(args))}',
        )
    call_id = data.get("id")
    return ToolCall(name, args, str(call_id) if call_id is not None else None), None


def _cut(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
