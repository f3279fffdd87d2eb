"""The OpenAI Responses API (``POST /v1/responses``) on an episode's session.

A request's ``input`` (a string, or items: messages, ``function_call`` items and their
``function_call_output``, reasoning items) becomes Chat Completions messages: ``instructions``
is the system message, an assistant ``message`` item and the ``function_call`` items after it are
one assistant message with ``tool_calls`` (as the session recorded the reply), a
``function_call_output`` is a ``tool`` message, and reasoning items are dropped (the trace keeps
the ids generated; the session compares assistant messages without their reasoning). Function
tools in the Responses' flat format become OpenAI's function format. The call is then served by
the session exactly as a Chat Completions call (same trajectory rules, same token ids).

``previous_response_id``: roll keeps, per response it returned with ``store`` true (the
Responses default), the conversation up to and including that response, for the episode only
(dropped when the session closes or is collected); a call naming one continues it (its
``instructions`` are not carried over, as in OpenAI's API: each call gives its own).

:data:`FIELDS` says, for every field of the request, what roll does with it (docs/agentic.md
shows the same table). A streamed reply (``stream: true``) is the Responses event stream
(``response.created`` ... ``response.completed``, each event with its ``sequence_number``),
written once generation is done, like the Chat Completions stream.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any

from roll_core.rollout.agentic.endpoint.calls import (
    CallOptions,
    ChatCall,
    EndpointError,
    Render,
    Reply,
    ToolChoice,
    bad,
    openai_error,
)
from roll_core.rollout.agentic.endpoint.fields import (
    Field,
    check_fields,
    extra_keys,
    get_bool,
    get_int,
    get_sampling,
    get_str,
    need_object,
)
from roll_core.rollout.agentic.endpoint.openai_chat import tools as chat_tools
from roll_core.rollout.agentic.endpoint.session import openai_call

API = "Responses API"
_SAMPLING = Field(
    "sampling",
    "the recipe's value is what applies; another value is refused (400), or replaced by the "
    "recipe's with rollout.agent_sampling: recipe",
)
_NO_EFFECT = "identification only (no effect on the reply, in OpenAI's definition either)"
_LOGPROBS = "message.output_text.logprobs"
_ENCRYPTED = "reasoning.encrypted_content"

FIELDS: dict[str, Field] = {
    "model": Field("honoured", "must name the served model or an alias (else 404 model_not_found)"),
    "input": Field(
        "honoured",
        "a string (one user message) or items: user / system / developer / assistant messages "
        "(text or input_text / output_text parts), function_call and function_call_output "
        "items; reasoning items are accepted and ignored (the trace keeps the ids generated)",
    ),
    "instructions": Field(
        "honoured",
        "the system message, first (not carried over by previous_response_id, as in OpenAI's API)",
    ),  # fmt: skip
    "previous_response_id": Field(
        "honoured",
        "continues the conversation of a response this episode returned with store: true "
        "(kept for the episode only; another id: 400 previous_response_not_found)",
    ),
    "store": Field(
        "honoured",
        "true (the default): the response is kept for previous_response_id until the episode "
        "ends; false: not kept",
    ),
    "tools": Field(
        "honoured",
        "function tools ({type: function, name, description, parameters, strict}) rendered by "
        "the chat template as OpenAI function tools (strict is passed on, not enforced: the "
        "arguments are the model's own); built-in tools (web_search, file_search, ...) are "
        "refused",
    ),
    "tool_choice": Field(
        "honoured",
        "auto; none (no function_call items); required / {type: function, name} (roll writes "
        "the call's opening into the prompt, as context); hosted-tool choices are refused",
    ),
    "parallel_tool_calls": Field("honoured", "false: generation stops after the first call"),
    "max_output_tokens": Field(
        "honoured",
        "the call's cap, at most rollout.max_new_tokens; status incomplete "
        "(max_output_tokens) when it ended the reply",
    ),
    "stream": Field("honoured", "the Responses event stream (response.created ... completed)"),
    "stream_options": Field("accepted", "include_obfuscation: roll adds no obfuscation field"),
    "include": Field(
        "honoured",
        f"{_LOGPROBS}: the behaviour log-prob of every generated token; {_ENCRYPTED}: the "
        "reasoning item's encrypted_content is its text (not encrypted; sent back, it is "
        "ignored like the rest of a reasoning item); other values are refused",
    ),
    "top_logprobs": Field(
        "honoured", f"0-20 alternatives per token, as the engine computed them (with {_LOGPROBS})"
    ),
    "text": Field(
        "refused",
        "only {format: {type: text}} is served: json_schema / json_object would need "
        "constrained decoding, which would make the sampled tokens differ from the policy's; "
        "verbosity is not served by a local model.",
        ({}, {"format": {"type": "text"}}),
    ),
    "reasoning": Field(
        "refused",
        "the chat template decides whether the model reasons; a per-call effort or summary is "
        "not served (null / {} are fine).",
        ({},),
    ),
    "truncation": Field(
        "refused",
        "auto would drop items from the start of the conversation, which the trained ids "
        "cannot do ('disabled' is fine; an overflow is a 400 context_length_exceeded).",
        ("disabled",),
    ),
    "temperature": _SAMPLING,
    "top_p": _SAMPLING,
    "user": Field("accepted", _NO_EFFECT),
    "safety_identifier": Field("accepted", _NO_EFFECT),
    "metadata": Field("accepted", "echoed in the response object"),
    "prompt_cache_key": Field("accepted", "a caching hint; the engine's prefix cache is automatic"),
    "max_tool_calls": Field(
        "refused",
        "it counts built-in tool calls, which are not served.",
    ),  # fmt: skip
    "background": Field(
        "refused", "responses are served in the request (false is fine).", (False,)
    ),
    "background_options": Field("refused", "background responses are not served."),
    "conversation": Field(
        "refused", "the Conversations API is not served: use previous_response_id or send items."
    ),
    "context_management": Field("refused", "server-side compaction is not served."),
    "prompt": Field("refused", "stored prompt templates are not served."),
    "service_tier": Field(
        "refused", "one tier only (auto / default are fine).", ("auto", "default")
    ),
    "moderation": Field("refused", "no moderation."),
    "image": Field("refused", "text only."),
    "access_programs": Field("refused", "not served."),
    "prompt_cache_options": Field("refused", "not served."),
    "prompt_cache_retention": Field("refused", "not served."),
}


# ---- the responses an episode keeps for previous_response_id -------------------------------------
class _Kept:
    """The conversations (Chat Completions messages, without ``instructions``) of the responses
    each open session returned with ``store`` true, by response id. A session's entries go when
    it closes (dropped at the next store) or is collected."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_session: dict[str, tuple[weakref.ref[Any], dict[str, list[Any]]]] = {}

    def get(self, session: Any, response_id: str) -> list[Any] | None:
        with self.lock:
            entry = self.by_session.get(session.token)
            return None if entry is None else entry[1].get(response_id)

    def put(self, session: Any, response_id: str, messages: list[Any]) -> None:
        with self.lock:
            for token, (ref, _) in list(self.by_session.items()):
                alive = ref()
                if alive is None or alive.closed:
                    del self.by_session[token]
            if session.token not in self.by_session:
                self.by_session[session.token] = (weakref.ref(session), {})
            self.by_session[session.token][1][response_id] = messages


KEPT = _Kept()


# ---- the request ---------------------------------------------------------------------------------
class _Request:
    """What a Responses request asks, beyond its call (echoed in the response object)."""

    def __init__(self, body: dict[str, Any], conversation: list[Any]) -> None:
        self.body = body
        self.conversation = conversation  # the messages after ``instructions``
        self.stream = bool(get_bool(body, "stream"))
        self.store = get_bool(body, "store") is not False
        include = body.get("include") or []
        self.logprobs = _LOGPROBS in include
        self.encrypted = _ENCRYPTED in include


def parse_responses(raw: Any, session: Any) -> tuple[ChatCall, _Request]:
    """A Responses request as a ChatCall (and what the response object echoes)."""
    body = need_object(raw, API)
    for name in ("text", "reasoning"):  # {"effort": null, ...}: the fields a client left unset
        if isinstance(body.get(name), dict):
            body = {**body, name: {k: v for k, v in body[name].items() if v is not None}}
    check_fields(body, FIELDS, API)
    _check_refused_shapes(body)
    earlier: list[Any] = []
    previous = get_str(body, "previous_response_id")
    if previous is not None:
        kept = KEPT.get(session, previous)
        if kept is None:
            raise EndpointError(
                400,
                f"Previous response with id '{previous}' not found. (roll keeps the responses "
                "of an episode, returned with store: true, for that episode only.)",
                "previous_response_not_found",
                param="previous_response_id",
            )
        earlier = list(kept)
    conversation = earlier + input_messages(body.get("input"), earlier)
    messages = list(conversation)
    instructions = get_str(body, "instructions")
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    if not messages:
        raise bad("`input` must be a string or a non-empty list of input items.", "input")
    request = _Request(body, conversation)
    top = get_int(body, "top_logprobs", lo=0, hi=20) or 0
    if top and not request.logprobs:
        raise bad(f"top_logprobs needs include: ['{_LOGPROBS}'].", "top_logprobs")
    get_bool(body, "parallel_tool_calls")
    options = CallOptions(
        max_tokens=get_int(body, "max_output_tokens", lo=1),
        tool_choice=tool_choice(body.get("tool_choice")),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        logprobs=request.logprobs,
        top_logprobs=top,
        sampling=get_sampling(body, ("temperature", "top_p")),
    )
    return ChatCall(messages, chat_tools(function_tools(body.get("tools"))), options), request


def _check_refused_shapes(body: dict[str, Any]) -> None:
    """The fields served in some shapes only: include, stream_options, metadata."""
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            raise bad("include must be a list of strings.", "include")
        other = [v for v in include if v not in (_LOGPROBS, _ENCRYPTED)]
        if other:
            raise bad(
                f"include {other[0]!r} is not served (only {_LOGPROBS!r} and {_ENCRYPTED!r}: "
                "built-in tools and image inputs are not served).",
                "include",
            )
    if body.get("stream_options") is not None and not body.get("stream"):
        raise bad("stream_options is only allowed with stream: true.", "stream_options")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad("metadata must be an object of string keys and string values.", "metadata")


def function_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Responses function tools (``{type: function, name, ...}``) in OpenAI's chat function
    format; a built-in tool is refused."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad("`tools` must be a list of {'type': 'function', 'name': ...} tools.", "tools")
    out = []
    for k, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad(
                f"tools[{k}] is a {kind!r} tool: roll serves function tools only (built-in "
                "tools such as web_search or file_search run on OpenAI's servers).",
                "tools",
            )
        unknown = extra_keys(tool, {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise bad(f"tools[{k}]: unsupported field(s) {unknown} for a function tool.", "tools")
        fn = {key: tool[key] for key in ("name", "description", "parameters", "strict") if
              tool.get(key) is not None}  # fmt: skip
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(raw: Any) -> ToolChoice:
    if raw is None:
        return ToolChoice()
    if raw in ("auto", "none", "required"):
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return ToolChoice("function", raw["name"])
    raise bad(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...} "
        "(hosted-tool and allowed_tools choices are not served).",
        "tool_choice",
    )


# ---- input items -> Chat Completions messages ---------------------------------------------------
_ROLES = ("user", "system", "developer", "assistant")
_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}


def input_messages(raw: Any, earlier: list[Any]) -> list[dict[str, Any]]:
    """The Chat Completions messages of ``input`` (``earlier``: the conversation it continues,
    where the function calls its outputs answer may be)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad("`input` must be a string or a list of input items.", "input")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being assembled
    names = {c["id"]: c["function"]["name"] for m in earlier for c in m.get("tool_calls") or []}
    for k, item in enumerate(raw):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object (an input item).", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":  # a new model turn: what follows it is one assistant message
            _flush(out, turn)
            turn = {"role": "assistant", "content": ""}
        elif kind == "message" and item.get("role") == "assistant":
            if turn is None or turn["content"] or turn.get("tool_calls"):
                _flush(out, turn)
                turn = {"role": "assistant", "content": ""}
            turn["content"] = _message_text(item, where)
        elif kind == "function_call":
            if turn is None:
                turn = {"role": "assistant", "content": ""}
            call = _function_call(item, where)
            names[call["id"]] = call["function"]["name"]
            turn.setdefault("tool_calls", []).append(call)
        else:
            _flush(out, turn)
            turn = None
            out.append(_other_item(item, kind, where, names))
    _flush(out, turn)
    return out


def _flush(out: list[dict[str, Any]], turn: dict[str, Any] | None) -> None:
    if turn is not None:
        out.append(turn)


def _other_item(item: dict[str, Any], kind: Any, where: str, names: dict[str, str]) -> Any:
    """A user / system / developer message, or a function_call_output, as a chat message."""
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}.", "input")
        return {"role": role, "content": _message_text(item, where)}
    if kind == "function_call_output":
        unknown = extra_keys(item, {"type", "call_id", "output", "id", "status"})
        call_id = item.get("call_id")
        if unknown or not isinstance(call_id, str):
            raise bad(
                f"{where} must be {{'type': 'function_call_output', 'call_id': str, 'output': "
                f"str}}{f' (unsupported field(s) {unknown})' if unknown else ''}.",
                "input",
            )
        message = {"role": "tool", "tool_call_id": call_id}
        message["content"] = _parts(item.get("output"), f"{where}.output", ("input_text",))
        if call_id in names:
            message["name"] = names[call_id]
        return message
    if kind == "item_reference":
        raise bad(
            f"{where} is an item_reference: items are not looked up by id; send the item, or "
            "continue a response with previous_response_id.",
            "input",
        )
    raise bad(
        f"{where} is a {kind!r} item: roll serves messages, function_call, function_call_output "
        "and reasoning items (built-in tools and their calls are not served).",
        "input",
    )


def _message_text(item: dict[str, Any], where: str) -> str:
    unknown = extra_keys(item, _MESSAGE_KEYS)
    if unknown:
        raise bad(f"{where}: unsupported field(s) {unknown} for a message item.", "input")
    return _parts(item.get("content"), f"{where}.content", ("input_text", "output_text"))


def _parts(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a string or of text parts (joined as given)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of {' / '.join(kinds)} parts.", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds or not isinstance(part.get("text"), str):  # type: ignore[union-attr]
            raise bad(
                f"{where}[{j}] is a {kind!r} part: roll's endpoint serves a text model and "
                f"takes {' / '.join(kinds)} parts ({{'type': ..., 'text': str}}).",
                "input",
            )
        texts.append(part["text"])  # type: ignore[index]
    return "".join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = extra_keys(item, {"type", "call_id", "name", "arguments", "id", "status"})
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if unknown or not all(isinstance(v, str) for v in (call_id, name, args)):
        raise bad(
            f"{where} must be {{'type': 'function_call', 'call_id': str, 'name': str, "
            f"'arguments': str (a JSON object)}}"
            f"{f' (unsupported field(s) {unknown})' if unknown else ''}.",
            "input",
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


# ---- the reply -----------------------------------------------------------------------------------
def _ids(reply: Reply) -> str:
    return f"{reply.session}_{reply.call_index}"


def _logprobs(reply: Reply) -> list[dict[str, Any]]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [
        {**entry(t.token, t.logprob), "top_logprobs": [entry(s, v) for s, v in t.top]}
        for t in reply.logprobs or ()
    ]


def output_items(reply: Reply, request: _Request | None = None) -> list[dict[str, Any]]:
    """The ``output`` of a response: a reasoning item (where the model reasoned), the message
    item (its text; always, unless the reply is tool calls only), the function_call items."""
    ids = _ids(reply)
    incomplete = reply.finish == "length"
    items: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        item = {
            "type": "reasoning",
            "id": f"rs_{ids}",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": reply.reasoning}],
            "status": "completed",
        }
        if request is not None and request.encrypted:
            item["encrypted_content"] = reply.reasoning
        items.append(item)
    if reply.content or not reply.tool_calls:
        part: dict[str, Any] = {"type": "output_text", "text": reply.content, "annotations": []}
        part["logprobs"] = _logprobs(reply)
        items.append(
            {
                "type": "message",
                "id": f"msg_{ids}",
                "status": "incomplete" if incomplete else "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for k, call in enumerate(reply.tool_calls):
        fn = openai_call(call)["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{ids}_{k}",
                "call_id": call.call_id,
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    return items


def response_body(
    reply: Reply | None, model: str, request: _Request, rid: str = "", reasoning_tokens: int = 0
) -> dict[str, Any]:
    """The ``response`` object (``reply`` None: the in-progress one a stream opens with;
    ``reasoning_tokens``: how many generated tokens the reasoning block took)."""
    body = request.body
    rid = rid or f"resp_{_ids(reply)}"  # type: ignore[arg-type]
    out: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": request.store,
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"),
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }
    if reply is None:
        return out
    out["output"] = output_items(reply, request)
    out["status"] = "incomplete" if reply.finish == "length" else "completed"
    if reply.finish == "length":
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    out["usage"] = {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": reply.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }
    notes = reply.notes()
    if notes:
        out["roll"] = notes
    return out


def response_events(
    reply: Reply, model: str, request: _Request, reasoning_tokens: int = 0
) -> list[dict[str, Any]]:
    """The events of a streamed response, in order, each with its ``sequence_number``."""
    final = response_body(reply, model, request, reasoning_tokens=reasoning_tokens)
    opening = response_body(None, model, request, final["id"])
    opening["created_at"] = final["created_at"]
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": opening},
        {"type": "response.in_progress", "response": opening},
    ]
    for index, item in enumerate(final["output"]):
        events += _item_events(index, item)
    events.append({"type": f"response.{final['status']}", "response": final})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    at = {"output_index": index}
    done = [{"type": "response.output_item.done", **at, "item": item}]
    if item["type"] == "function_call":
        added = {**item, "arguments": "", "status": "in_progress"}
        ref = {**at, "item_id": item["id"]}
        return [
            {"type": "response.output_item.added", **at, "item": added},
            {"type": "response.function_call_arguments.delta", **ref, "delta": item["arguments"]},
            {
                "type": "response.function_call_arguments.done",
                **ref,
                "name": item["name"],
                "arguments": item["arguments"],
            },  # fmt: skip
            *done,
        ]
    if item["type"] == "reasoning":
        added = {**item, "content": [], "status": "in_progress"}
        added.pop("encrypted_content", None)
        text = item["content"][0]["text"]
        ref = {**at, "item_id": item["id"], "content_index": 0}
        return [
            {"type": "response.output_item.added", **at, "item": added},
            {"type": "response.reasoning_text.delta", **ref, "delta": text},
            {"type": "response.reasoning_text.done", **ref, "text": text},
            *done,
        ]
    part = item["content"][0]
    ref = {**at, "item_id": item["id"], "content_index": 0}
    events = [
        {
            "type": "response.output_item.added",
            **at,
            "item": {**item, "content": [], "status": "in_progress"},
        },  # fmt: skip
        {
            "type": "response.content_part.added",
            **ref,
            "part": {**part, "text": "", "logprobs": []},
        },  # fmt: skip
    ]
    for k, piece in enumerate(_pieces(part["text"])):
        delta = {"type": "response.output_text.delta", **ref, "delta": piece}
        events.append({**delta, "logprobs": part["logprobs"] if k == 0 else []})
    events += [
        {
            "type": "response.output_text.done",
            **ref,
            "text": part["text"],
            "logprobs": part["logprobs"],
        },  # fmt: skip
        {"type": "response.content_part.done", **ref, "part": part},
        *done,
    ]
    return events


def _pieces(text: str, size: int = 32) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def sse(events: list[dict[str, Any]]) -> bytes:
    """Server-Sent Events as OpenAI sends the Responses stream: an ``event:`` line with the
    event's type, then its ``data:`` line."""
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def reasoning_tokens(reply: Reply, tokenizer: Any) -> int:
    """How many of the generated ids the reasoning block took: the shortest prefix whose text
    holds ``</think>`` (all of them for a block the cap cut; a binary search, as a longer
    prefix holds it whenever a shorter one does)."""
    ids = reply.completion.response_ids
    if reply.reasoning is None or not ids:
        return 0
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if "</think>" in str(tokenizer.decode(ids[:mid], skip_special_tokens=True)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def assistant_message(reply: Reply) -> dict[str, Any]:
    """The reply as the assistant message of the conversation the session recorded."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [openai_call(c) for c in reply.tool_calls]
    return message


class Responses:
    """The Responses API on a session (see :class:`~.calls.Api`)."""

    name = API
    route = "/v1/responses"

    def parse(self, raw: Any, session: Any, model: str) -> tuple[ChatCall, Render]:
        call, request = parse_responses(raw, session)

        def render(reply: Reply) -> tuple[str, bytes]:
            rid = f"resp_{_ids(reply)}"
            if request.store:  # a retry of an undelivered reply has the same id: replaced
                KEPT.put(session, rid, [*request.conversation, assistant_message(reply)])
            thought = reasoning_tokens(reply, session.chat.tokenizer)
            if request.stream:
                return "text/event-stream", sse(response_events(reply, model, request, thought))
            body = response_body(reply, model, request, reasoning_tokens=thought)
            return "application/json", json.dumps(body).encode()

        return call, render

    def error_body(self, err: EndpointError) -> dict[str, Any]:
        return openai_error(err)
