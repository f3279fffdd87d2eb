"""Anthropic Messages (``POST /v1/messages``) on an episode's session.

An Anthropic client takes the session's base URL without ``/v1``
(``http://127.0.0.1:PORT/s/<token>``); any ``x-api-key`` / ``anthropic-version`` is accepted.
A request becomes Chat Completions messages: ``system`` is the system message, a user message's
``tool_result`` blocks are ``tool`` messages (``tool_call_id``: the ``tool_use_id``) followed by
its text as one user message, an assistant message's ``tool_use`` blocks are its ``tool_calls``
(``arguments``: the ``input`` as JSON, as the session recorded the reply), and ``thinking`` /
``redacted_thinking`` blocks are dropped (the trace keeps the ids generated; the session compares
assistant messages without their reasoning). Text blocks are joined as given, as OpenAI text
parts are. Tools (``{name, description, input_schema}``) become OpenAI function tools. The call
is then served by the session exactly as a Chat Completions call (same trajectory rules, same
token ids).

The reply is a ``message``: a ``thinking`` block where the model wrote ``<think>`` (with a
``signature`` roll ignores when it comes back), a ``text`` block, ``tool_use`` blocks, and the
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` with the ``stop_sequence``, or
``tool_use``). A streamed reply is Anthropic's event stream (``message_start`` ...
``message_stop``), written once generation is done. Errors are Anthropic's
``{"type": "error", "error": {"type", "message"}}``; a context overflow reads
"prompt is too long: N tokens > M maximum", the words Claude Code and litellm act on.

:data:`FIELDS` says, for every field of the request, what roll does with it (docs/agentic.md
shows the same table).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from roll_core.rollout.agentic.endpoint.calls import (
    CallOptions,
    ChatCall,
    EndpointError,
    Render,
    Reply,
    ToolChoice,
    bad,
)
from roll_core.rollout.agentic.endpoint.fields import (
    Field,
    check_fields,
    extra_keys,
    get_bool,
    get_int,
    get_sampling,
    get_stops,
    need_object,
)
from roll_core.rollout.agentic.endpoint.openai_chat import tools as chat_tools

API = "Anthropic Messages"
_SAMPLING = Field(
    "sampling",
    "the recipe's value is what applies; another value is refused (400), or replaced by the "
    "recipe's with rollout.agent_sampling: recipe",
)

FIELDS: dict[str, Field] = {
    "model": Field(
        "honoured",
        "must name the served model or an alias, e.g. a Claude model name a harness sends "
        "(rollout.agent_model_aliases; else 404 not_found_error)",
    ),
    "max_tokens": Field(
        "honoured",
        "required; the call's cap, at most rollout.max_new_tokens (stop_reason max_tokens "
        "when it ended the reply)",
    ),
    "messages": Field(
        "honoured",
        "user / assistant messages of text, tool_use, tool_result (is_error: the result's text "
        "is what the model sees, the template has no error flag) and thinking / "
        "redacted_thinking blocks (accepted, ignored: the trace keeps the ids generated); "
        "image / document blocks are refused",
    ),
    "system": Field("honoured", "the system message (a string or text blocks)"),
    "tools": Field(
        "honoured",
        "custom tools ({name, description, input_schema}) rendered by the chat template as "
        "OpenAI function tools; server tools (a type such as web_search_20250305) are refused",
    ),
    "tool_choice": Field(
        "honoured",
        "auto; none (no tool_use blocks); any / {type: tool, name} (roll writes the call's "
        "opening into the prompt, as context); disable_parallel_tool_use: generation stops "
        "after the first call",
    ),
    "stop_sequences": Field(
        "honoured", "the reply ends before the first one (stop_reason stop_sequence)"
    ),
    "stream": Field("honoured", "Anthropic's event stream (message_start ... message_stop)"),
    "thinking": Field(
        "honoured",
        "the chat template decides whether the model reasons: thinking blocks carry its "
        "<think> text. enabled / adaptive: 400 unless the template reasons (budget_tokens is "
        "checked, >= 1024 and < max_tokens, but the one cap roll applies is max_tokens, "
        "thinking and text together); disabled: 400 if the template reasons; between_tools: "
        "400",
    ),
    "temperature": _SAMPLING,
    "top_p": _SAMPLING,
    "top_k": _SAMPLING,
    "metadata": Field("accepted", "user_id: identification only (no effect on the reply)"),
    "cache_control": Field(
        "accepted", "a caching hint; the engine's prefix cache is automatic (also on blocks)"
    ),
    "service_tier": Field("accepted", "one tier only: standard (auto / standard_only)"),
    "user_profile_id": Field("accepted", "identification only (no effect on the reply)"),
    "workspace_id": Field("accepted", "identification only (no effect on the reply)"),
    "output_config": Field(
        "refused",
        "format (JSON outputs) would need constrained decoding, which would make the sampled "
        "tokens differ from the policy's; a per-call effort is not served ({} is fine).",
        ({},),
    ),
    "container": Field("refused", "no code-execution container."),
    "inference_geo": Field("refused", "the model runs where the run runs."),
    "speed": Field("refused", "one speed only (standard is fine).", ("standard",)),
    "diagnostics": Field("refused", "not served."),
}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(err: EndpointError) -> dict[str, Any]:
    """An error in Anthropic's shape; a context overflow in Anthropic's words."""
    message = str(err)
    if err.code == "context_length_exceeded" and err.detail:
        d = err.detail
        total = d["prompt_tokens"] + d["max_tokens"]
        message = (
            f"prompt is too long: {total} tokens > {d['limit']} maximum (roll: "
            f"{d['prompt_tokens']} tokens of messages + max_tokens {d['max_tokens']} do not fit "
            "rollout.max_context; the episode ends here, with status `context`)"
        )
    default = "api_error" if err.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, default),
                                       "message": message}}  # fmt: skip


# ---- the request ---------------------------------------------------------------------------------
def parse_messages(raw: Any, session: Any) -> tuple[ChatCall, bool]:
    """An Anthropic Messages request as a ChatCall, and whether to stream."""
    body = need_object(raw, API)
    check_fields(body, FIELDS, API)
    max_tokens = get_int(body, "max_tokens", lo=1)
    if max_tokens is None:
        raise bad("max_tokens: Field required (the most tokens the reply may have).", "max_tokens")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad("`messages` must be a non-empty list of user / assistant messages.", "messages")
    messages = chat_messages(raw_messages)
    if body.get("system") is not None:
        messages.insert(0, {"role": "system", "content": _text_blocks(body["system"], "system")})
    _check_thinking(body.get("thinking"), max_tokens, session)
    choice, parallel = tool_choice(body.get("tool_choice"))
    call = ChatCall(
        messages=messages,
        tools=chat_tools(custom_tools(body.get("tools"))),
        options=CallOptions(
            max_tokens=max_tokens,
            stop=get_stops(body, "stop_sequences", None),
            tool_choice=choice,
            parallel_tool_calls=parallel,
            sampling=get_sampling(body, ("temperature", "top_p", "top_k")),
        ),
    )
    return call, bool(get_bool(body, "stream"))


def _check_thinking(raw: Any, max_tokens: int, session: Any) -> None:
    """``thinking``: served as the chat template does it (see FIELDS), else 400."""
    if raw is None:
        return
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise bad(
            "thinking must be {type: enabled, budget_tokens} or {type: disabled}.", "thinking"
        )
    if kind == "between_tools":
        raise bad("thinking between_tools is not served: the template decides.", "thinking")
    if kind == "enabled":
        budget = raw.get("budget_tokens")
        if (
            isinstance(budget, bool)
            or not isinstance(budget, int)
            or not 1024 <= budget < max_tokens
        ):
            raise bad(
                f"thinking.budget_tokens must be an integer, at least 1024 and less than "
                f"max_tokens ({max_tokens}), got {budget!r}.",
                "thinking",
            )
    from roll_core.data.chat import reasoning_format

    reasons = reasoning_format(session.chat.tokenizer).markers is not None
    if kind == "disabled" and reasons:
        raise bad(
            "thinking disabled cannot be honoured: the chat template makes the model reason "
            "(<think> ... </think>) and a call cannot turn that off. Leave thinking out (the "
            "reply's thinking block carries the reasoning), or set rollout.chat_template to a "
            "template without reasoning.",
            "thinking",
        )
    if kind in ("enabled", "adaptive") and not reasons:
        raise bad(
            f"thinking {kind} cannot be honoured: the chat template has no reasoning block "
            "(<think> ... </think>), so the model does not think before answering. Leave "
            "thinking out, or set rollout.chat_template to a reasoning template (e.g. Qwen3's).",
            "thinking",
        )


def custom_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Anthropic custom tools in OpenAI's function format; a server tool is refused."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad("`tools` must be a list of {name, description, input_schema} tools.", "tools")
    out = []
    for k, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise bad(f"tools[{k}] must be an object.", "tools")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad(
                f"tools[{k}] is the server tool {kind!r}: roll serves custom tools only "
                "({name, description, input_schema}); server tools run on Anthropic's servers.",
                "tools",
            )
        unknown = extra_keys(tool, {"type", "name", "description", "input_schema",
                                       "cache_control", "strict"})  # fmt: skip
        if unknown:
            raise bad(f"tools[{k}]: unsupported field(s) {unknown} for a custom tool.", "tools")
        fn: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema")
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(raw: Any) -> tuple[ToolChoice, bool]:
    """``tool_choice`` as the session's ToolChoice, and whether parallel calls are allowed."""
    if raw is None:
        return ToolChoice(), True
    kind = raw.get("type") if isinstance(raw, dict) else None
    modes = {"auto": "auto", "any": "required", "none": "none", "tool": "function"}
    name = raw.get("name") if isinstance(raw, dict) else None
    if kind not in modes or (kind == "tool") != isinstance(name, str):
        raise bad(
            "tool_choice must be {type: auto | any | none} or {type: tool, name: str} "
            "(disable_parallel_tool_use: true / false).",
            "tool_choice",
        )
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad("tool_choice.disable_parallel_tool_use must be true or false.", "tool_choice")
    return ToolChoice(modes[kind], name), not disable  # type: ignore[arg-type]


# ---- messages -> Chat Completions messages -------------------------------------------------------
_TEXT_KEYS = {"type", "text", "cache_control", "citations"}


def chat_messages(raw: list[Any]) -> list[dict[str, Any]]:
    """The Chat Completions messages of Anthropic ``messages``."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages
    for k, msg in enumerate(raw):
        where = f"messages[{k}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("user", "assistant", "system") or extra_keys(msg, {"role", "content"}):
            raise bad(
                f"{where} must be {{'role': 'user' | 'assistant', 'content': ...}}.", "messages"
            )
        content = msg.get("content")
        if role == "system":
            out.append({"role": "system", "content": _text_blocks(content, where)})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad(f"{where}.content must be a string or a list of content blocks.", "messages")
        elif role == "assistant":
            out.append(_assistant(content, where, names))
        else:
            out += _user(content, where, names)
    return out


def _assistant(blocks: list[Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    texts: list[str] = []
    calls = []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}.content[{j}]")
        if kind == "text":
            texts.append(_text(block, f"{where}.content[{j}]"))
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}.content[{j}]"))
            names[calls[-1]["id"]] = calls[-1]["function"]["name"]
        elif kind not in ("thinking", "redacted_thinking"):
            raise _block_refused(kind, f"{where}.content[{j}]", "text, tool_use, thinking")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user message: its tool results (``tool`` messages), then its text (one user
    message, where it has text blocks)."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            unknown = extra_keys(block, {"type", "tool_use_id", "content", "is_error",
                                           "cache_control"})  # fmt: skip
            call_id = block.get("tool_use_id")
            if unknown or not isinstance(call_id, str):
                raise bad(
                    f"{at} must be {{'type': 'tool_result', 'tool_use_id': str, 'content': str "
                    f"or text blocks, 'is_error': bool}}"
                    f"{f' (unsupported field(s) {unknown})' if unknown else ''}.",
                    "messages",
                )
            if block.get("is_error") not in (None, True, False):
                raise bad(f"{at}.is_error must be true or false.", "messages")
            content = block.get("content")
            text = "" if content is None else _text_blocks(content, f"{at}.content")
            result = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                result["name"] = names[call_id]
            results.append(result)
        else:
            raise _block_refused(kind, at, "text, tool_result")
    if texts or not results:
        results.append({"role": "user", "content": "".join(texts)})
    return results


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(f"{where} must be a content block ({{'type': ..., ...}}).", "messages")
    return str(block["type"])


def _block_refused(kind: str, where: str, served: str) -> EndpointError:
    why = (
        "roll's endpoint serves a text model"
        if kind in ("image", "document", "search_result")
        else "it is not served here"
    )
    return bad(f"{where} is a {kind!r} block: {why} (this message takes {served} blocks).",
               "messages")  # fmt: skip


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str) or extra_keys(block, _TEXT_KEYS):
        raise bad(f"{where} must be {{'type': 'text', 'text': str}}.", "messages")
    return str(block["text"])


def _text_blocks(content: Any, where: str) -> str:
    """A string, or text blocks joined as given."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text blocks.", "messages")
    texts = []
    for j, block in enumerate(content):
        kind = _kind(block, f"{where}[{j}]")
        if kind != "text":
            raise _block_refused(kind, f"{where}[{j}]", "text")
        texts.append(_text(block, f"{where}[{j}]"))
    return "".join(texts)


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = extra_keys(block, {"type", "id", "name", "input", "cache_control", "caller"})
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if (
        unknown
        or not isinstance(call_id, str)
        or not isinstance(name, str)
        or not isinstance(args, dict)
    ):
        raise bad(
            f"{where} must be {{'type': 'tool_use', 'id': str, 'name': str, 'input': object}}"
            f"{f' (unsupported field(s) {unknown})' if unknown else ''}.",
            "messages",
        )
    fn = {"name": name, "arguments": json.dumps(args)}
    return {"id": call_id, "type": "function", "function": fn}


# ---- the reply -----------------------------------------------------------------------------------
def _stop_reason(reply: Reply) -> str:
    if reply.finish == "tool_calls":
        return "tool_use"
    if reply.finish == "length":
        return "max_tokens"
    return "stop_sequence" if reply.stop_sequence is not None else "end_turn"


def tool_use_id(call_id: str | None) -> str:
    """The ``tool_use`` id of a session's call id (``call_3_0`` -> ``toolu_3_0``)."""
    return "toolu_" + str(call_id).removeprefix("call_")


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        signature = hashlib.sha256(reply.reasoning.encode()).hexdigest()
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": signature})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        use = {"type": "tool_use", "id": tool_use_id(call.call_id), "name": call.name}
        blocks.append({**use, "input": call.arguments})
    return blocks


def message_body(reply: Reply, model: str, *, started: bool = False) -> dict[str, Any]:
    """The ``message`` object of a reply (``started``: as a stream's ``message_start`` has it)."""
    out: dict[str, Any] = {
        "id": f"msg_{reply.session}_{reply.call_index}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [] if started else content_blocks(reply),
        "stop_reason": None if started else _stop_reason(reply),
        "stop_sequence": None if started else reply.stop_sequence,
        "usage": {
            "input_tokens": reply.prompt_tokens,
            "output_tokens": 0 if started else reply.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    notes = reply.notes()
    if notes and not started:
        out["roll"] = notes
    return out


def message_events(reply: Reply, model: str) -> list[dict[str, Any]]:
    """The events of a streamed reply, in order (Anthropic's event stream)."""
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": message_body(reply, model, started=True)}
    ]
    for index, block in enumerate(content_blocks(reply)):
        at = {"index": index}
        if block["type"] == "thinking":
            start = {**block, "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                      {"type": "signature_delta", "signature": block["signature"]}]  # fmt: skip
        elif block["type"] == "text":
            start = {**block, "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in _pieces(block["text"])]
        else:
            start = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        events.append({"type": "content_block_start", **at, "content_block": start})
        events += [{"type": "content_block_delta", **at, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", **at})
    delta = {"stop_reason": _stop_reason(reply), "stop_sequence": reply.stop_sequence}
    last: dict[str, Any] = {"type": "message_delta", "delta": delta}
    last["usage"] = {"output_tokens": reply.completion_tokens}
    if reply.notes():
        last["roll"] = reply.notes()
    events += [last, {"type": "message_stop"}]
    return events


def _pieces(text: str, size: int = 32) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def sse(events: list[dict[str, Any]]) -> bytes:
    """Anthropic's framing: ``event: NAME`` then the event's ``data:`` line."""
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


class AnthropicMessages:
    """Anthropic Messages on a session (see :class:`~.calls.Api`)."""

    name = API
    route = "/v1/messages"

    def parse(self, raw: Any, session: Any, model: str) -> tuple[ChatCall, Render]:
        call, stream = parse_messages(raw, session)

        def render(reply: Reply) -> tuple[str, bytes]:
            if stream:
                return "text/event-stream", sse(message_events(reply, model))
            return "application/json", json.dumps(message_body(reply, model)).encode()

        return call, render

    def error_body(self, err: EndpointError) -> dict[str, Any]:
        return error_body(err)


class AnthropicCountTokens:
    """``POST /v1/messages/count_tokens`` (Claude Code asks it before a call): the prompt
    tokens the same request to /v1/messages would be given, as the session would render it
    now (continued or a new segment); nothing is generated or recorded."""

    name = API
    route = "/v1/messages/count_tokens"
    counts_tokens = True

    def parse(self, raw: Any, session: Any, model: str) -> tuple[ChatCall, Render]:
        body = need_object(raw, API)
        if "max_tokens" in body:
            raise bad("Unrecognized request argument supplied: max_tokens (count_tokens).")
        call, _ = parse_messages({**body, "max_tokens": 2**31 - 1}, session)

        def render(reply: Reply) -> tuple[str, bytes]:  # never called: nothing is generated
            raise AssertionError("count_tokens has no reply")

        return call, render

    def error_body(self, err: EndpointError) -> dict[str, Any]:
        return error_body(err)
