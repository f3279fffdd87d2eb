"""OpenAI Chat Completions (``POST /v1/chat/completions``) on an episode's session.

:data:`FIELDS` says, for every field of the request, what roll does with it (docs/agentic.md
shows the same table). A streamed reply (``stream: true``) is sent as Server-Sent Events in
OpenAI's chunk format (role, content, tool-call deltas, the finish chunk, with
``stream_options.include_usage`` a final usage chunk, then ``[DONE]``); roll's engines answer a
request when it is finished, so the events are written together once generation is done, and
the trajectory recorded is the same as without streaming.
"""

from __future__ import annotations

import json
import time
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
    SAMPLING,
    Field,
    check_fields,
    get_bool,
    get_int,
    get_sampling,
    get_stops,
    need_object,
)
from roll_core.rollout.agentic.endpoint.session import openai_call

_SAMPLING = Field(
    "sampling",
    "the recipe's value (or the neutral one) is what applies; another value is refused (400), "
    "or replaced by the recipe's with rollout.agent_sampling: recipe",
)
_NO_EFFECT = "identification only (no effect on the reply, in OpenAI's definition either)"

FIELDS: dict[str, Field] = {
    "model": Field("honoured", "must name the served model or an alias (else 404 model_not_found)"),
    "messages": Field(
        "honoured",
        "system / developer / user / assistant (with tool_calls) / tool messages, text content "
        "or text parts; continued, or a new segment (rollout.agent_history)",
    ),
    "tools": Field(
        "honoured",
        "function tools, rendered by the chat template; with strict: true a call whose "
        "arguments break the schema comes back as content (an invalid action)",
    ),
    "tool_choice": Field(
        "honoured",
        "auto; none (no tool_calls in the reply); required / a named function (roll writes "
        "the call's opening into the prompt, as context)",
    ),
    "parallel_tool_calls": Field("honoured", "false: generation stops after the first call"),
    "stream": Field("honoured", "Server-Sent Events in OpenAI's chunk format"),
    "stream_options": Field("honoured", "include_usage: the final usage chunk"),
    "max_tokens": Field("honoured", "the call's cap, at most rollout.max_new_tokens"),
    "max_completion_tokens": Field("honoured", "as max_tokens"),
    "stop": Field("honoured", "up to 4 strings; the reply ends before the first one"),
    "logprobs": Field("honoured", "the behaviour log-prob of every generated token"),
    "top_logprobs": Field("honoured", "0-20 alternatives per token, as the engine computed them"),
    "n": Field("refused", "n > 1 is not served: make one call per sample (n: 1 is fine).", (1,)),
    "response_format": Field(
        "refused",
        "json_object / json_schema would need constrained decoding, which would make the "
        "sampled tokens differ from the policy's; only {'type': 'text'} is served.",
        ({"type": "text"},),
    ),
    **{name: _SAMPLING for name in SAMPLING},
    "user": Field("accepted", _NO_EFFECT),
    "safety_identifier": Field("accepted", _NO_EFFECT),
    "prompt_cache_key": Field("accepted", "a caching hint; the engine's prefix cache is automatic"),
    "metadata": Field("accepted", "stored nowhere (store is not served)"),
    "store": Field(
        "refused", "nothing is stored by roll's endpoint (store: false is fine).", (False,)
    ),
    "service_tier": Field(
        "refused", "one tier only (auto / default are fine).", ("auto", "default")
    ),
    "modalities": Field("refused", "text only (['text'] is fine).", (["text"],)),
    "reasoning_effort": Field(
        "refused",
        "the chat template decides whether the model reasons; a per-call effort is not served.",
    ),
    "verbosity": Field("refused", "not served by a local model."),
    "audio": Field("refused", "text only."),
    "prediction": Field("refused", "predicted outputs are not served."),
    "web_search_options": Field("refused", "no web search."),
    "functions": Field("refused", "deprecated: use tools."),
    "function_call": Field("refused", "deprecated: use tool_choice."),
    "moderation": Field("refused", "no moderation."),
    "prompt_cache_options": Field("refused", "not served."),
    "prompt_cache_retention": Field("refused", "not served."),
}


def parse_chat(raw: Any) -> tuple[ChatCall, bool, bool]:
    """A Chat Completions request as a ChatCall, and whether to stream (and include usage)."""
    body = need_object(raw, "Chat Completions")
    check_fields(body, FIELDS, "Chat Completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("`messages` must be a non-empty list of chat messages.", "messages")
    stream = bool(get_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise bad("stream_options takes include_usage (true / false).", "stream_options")
        if not stream:
            raise bad("stream_options is only allowed with stream: true.", "stream_options")
        include_usage = bool(get_bool(options, "include_usage"))
    logprobs = bool(get_bool(body, "logprobs"))
    top = get_int(body, "top_logprobs", lo=0, hi=20) or 0
    if top and not logprobs:
        raise bad("top_logprobs needs logprobs: true.", "top_logprobs")
    max_tokens = get_int(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", lo=1)
    get_bool(body, "parallel_tool_calls")
    call = ChatCall(
        messages=messages,
        tools=tools(body.get("tools")),
        options=CallOptions(
            max_tokens=max_tokens,
            stop=get_stops(body, "stop", 4),
            tool_choice=tool_choice(body.get("tool_choice")),
            parallel_tool_calls=body.get("parallel_tool_calls") is not False,
            logprobs=logprobs,
            top_logprobs=top,
            sampling=get_sampling(body),
        ),
    )
    return call, stream, include_usage


def tools(raw: Any) -> list[dict[str, Any]] | None:
    """Function tools in OpenAI's format (each checked), or None."""
    from roll_core.envs.tools import schema_problems

    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad("`tools` must be a list of {'type': 'function', 'function': {...}}.", "tools")
    for k, tool in enumerate(raw):
        problems = schema_problems(tool)
        if problems:
            raise bad(f"tools[{k}] is not a valid tool: {'; '.join(problems)}.", "tools")
    return raw


def tool_choice(raw: Any) -> ToolChoice:
    if raw is None:
        return ToolChoice()
    if raw in ("auto", "none", "required"):
        return ToolChoice(raw)
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        return ToolChoice("function", fn["name"])
    raise bad(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
        "{'name': ...}}.",
        "tool_choice",
    )


# ---- the reply -----------------------------------------------------------------------------------
def _message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content if reply.content or not reply.tool_calls else None,
        "refusal": None,
    }
    if reply.tool_calls:
        message["tool_calls"] = [openai_call(c) for c in reply.tool_calls]
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    return message


def _logprobs(reply: Reply) -> dict[str, Any] | None:
    if reply.logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = [
        {**entry(t.token, t.logprob), "top_logprobs": [entry(s, v) for s, v in t.top]}
        for t in reply.logprobs
    ]
    return {"content": content, "refusal": None}


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _head(reply: Reply, model: str, kind: str) -> dict[str, Any]:
    head: dict[str, Any] = {
        "id": f"chatcmpl-{reply.session}-{reply.call_index}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }
    return head


def chat_body(reply: Reply, model: str) -> dict[str, Any]:
    """The ``chat.completion`` object of a reply."""
    body = _head(reply, model, "chat.completion")
    body["choices"] = [
        {
            "index": 0,
            "message": _message(reply),
            "finish_reason": reply.finish,
            "logprobs": _logprobs(reply),
        }
    ]
    body["usage"] = _usage(reply)
    notes = reply.notes()
    if notes:
        body["roll"] = notes
    return body


def chat_events(reply: Reply, model: str, include_usage: bool) -> list[dict[str, Any] | str]:
    """The ``chat.completion.chunk`` events of a streamed reply, then ``[DONE]``."""
    head = _head(reply, model, "chat.completion.chunk")
    if include_usage:
        head["usage"] = None
    notes = reply.notes()

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [{**choice, **extra}]}

    events: list[dict[str, Any] | str] = [chunk({"role": "assistant", "content": ""})]
    if reply.reasoning is not None:
        events.append(chunk({"reasoning_content": reply.reasoning}))
    logprobs = _logprobs(reply)
    pieces = _pieces(reply.content)
    for k, piece in enumerate(pieces or ([""] if logprobs else [])):
        events.append(chunk({"content": piece}, logprobs=logprobs if k == 0 else None))
    for i, call in enumerate(reply.tool_calls):
        fn = openai_call(call)
        opening = {"index": i, "id": fn["id"], "type": "function"}
        opening["function"] = {"name": call.name, "arguments": ""}
        events.append(chunk({"tool_calls": [opening]}))
        args = {"index": i, "function": {"arguments": fn["function"]["arguments"]}}
        events.append(chunk({"tool_calls": [args]}))
    last = chunk({}, reply.finish)
    if notes:
        last["roll"] = notes
    events.append(last)
    if include_usage:
        events.append({**head, "choices": [], "usage": _usage(reply)})
    events.append("[DONE]")
    return events


def _pieces(text: str, size: int = 32) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def sse(events: list[dict[str, Any] | str]) -> bytes:
    """Server-Sent Events: one ``data:`` line per event (OpenAI's stream framing)."""
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


class ChatCompletions:
    """The Chat Completions API on a session (see :class:`~.calls.Api`)."""

    name = "Chat Completions"
    route = "/v1/chat/completions"

    def parse(self, raw: Any, session: Any, model: str) -> tuple[ChatCall, Render]:
        call, stream, include_usage = parse_chat(raw)

        def render(reply: Reply) -> tuple[str, bytes]:
            if stream:
                return "text/event-stream", sse(chat_events(reply, model, include_usage))
            return "application/json", json.dumps(chat_body(reply, model)).encode()

        return call, render

    def error_body(self, err: EndpointError) -> dict[str, Any]:
        return openai_error(err)
