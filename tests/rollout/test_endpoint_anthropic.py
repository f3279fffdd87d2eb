"""Anthropic Messages on the agent endpoint: hand-written bodies to ChatCalls, replies to
messages and event streams, then the real ``anthropic`` client (``messages.create`` sync and
async, ``stream=True`` and ``messages.stream``) against a real endpoint with the scripted model of
test_endpoint_chat.py (a ``calc`` call for a question, two calls for "two", text for "chat" and
after a tool result; for "think", a ``<think>`` block before the call).

The same conversation through Anthropic Messages and through Chat Completions gives the same
trajectory, id for id."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from roll_core.backends.infer import Completion, SamplingParams
from roll_core.envs.tool_parsers import ToolCall
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.models.loading import use_chat_template
from roll_core.rollout.agentic import ChatFormat, Trajectory
from roll_core.rollout.agentic.endpoint import AgentEndpoint, AgentSession, EndpointError, Reply
from roll_core.rollout.agentic.endpoint.anthropic import (
    FIELDS,
    error_body,
    message_body,
    message_events,
    parse_messages,
)
from roll_core.rollout.agentic.endpoint.calls import CallOptions, ToolChoice
from roll_core.rollout.agentic.endpoint.fields import table_rows
from tests.rollout.test_endpoint_chat import TEMPLATE, TOOLS, Scripted, done, open_session, raw

ROOT = Path(__file__).resolve().parents[2]
ATOOLS = [  # Anthropic's tool format
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
ANSWER = "The answer is 42. END of story"
THINK = "<think>\nI multiply.\n</think>\n\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tokenizer = load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("m"))))
    use_chat_template(tokenizer, TEMPLATE)
    return tokenizer


@pytest.fixture(scope="module")
def reasoning_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tool template as a reasoning template: an earlier assistant turn is written without
    its ``<think>`` block (as Qwen3's template does)."""
    tokenizer = load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("r"))))
    text = Path(TEMPLATE).read_text()
    plain = "{{- message['content'] }}"
    assert text.count(plain) == 1
    path = tmp_path_factory.mktemp("t") / "reasoning.jinja"
    path.write_text(text.replace(plain, "{{- message['content'].split('</think>')[-1] }}"))
    use_chat_template(tokenizer, str(path))
    return tokenizer


class Thinking(Scripted):
    """The scripted model, reasoning before its call when the question is "think"."""

    def text(self, prompt: str) -> str:
        if prompt.endswith("<|im_start|>user\nthink<|im_end|>\n<|im_start|>assistant\n"):
            return THINK + super().text(prompt.replace("think<|im_end|>", "6*7<|im_end|>"))
        return super().text(prompt)


@pytest.fixture()
def endpoint() -> Any:
    ep = AgentEndpoint(
        port=0, model="builtin:tiny-qwen3", aliases=("claude-sonnet-4-5",), read_timeout_s=1
    )
    yield ep
    ep.close()


def client(endpoint: AgentEndpoint, s: AgentSession) -> anthropic.Anthropic:
    base = endpoint.base_url(s).removesuffix("/v1")  # Anthropic clients add /v1 themselves
    return anthropic.Anthropic(base_url=base, api_key="roll", max_retries=0)


def create(endpoint: AgentEndpoint, s: AgentSession, content: Any = "6*7", **kw: Any) -> Any:
    kw.setdefault("tools", ATOOLS)
    kw.setdefault("max_tokens", 80)
    messages = kw.pop("messages", [{"role": "user", "content": content}])
    kw.setdefault("model", "policy")
    return client(endpoint, s).messages.create(messages=messages, **kw)


def thinking_session(tok: Any, endpoint: AgentEndpoint) -> AgentSession:
    s = AgentSession(
        Trajectory("calc", 0, 0, 0),
        ChatFormat(tok),
        Thinking(tok),
        200,
        1024,
        "builtin:tiny-qwen3",
        history="strict",
        sampling=SamplingParams(max_new_tokens=80, temperature=1.0),
    )
    endpoint.open(s)
    return s


def trace(s: AgentSession) -> tuple[list[int], list[int], list[float]]:
    t = done(s).trace
    return list(t.ids), list(t.mask), list(t.log_probs)


class _Session:
    def __init__(self, tok: Any) -> None:
        self.chat = ChatFormat(tok)


# ---- the field table --------------------------------------------------------------------------
def test_docs_show_the_table_and_it_has_every_field_of_the_client() -> None:
    import typing

    from anthropic.types import message_create_params as m

    fields = set(typing.get_type_hints(m.MessageCreateParamsNonStreaming)) | {"stream"}
    sampling = {"temperature", "top_p", "top_k"}  # older clients still send them
    assert fields <= set(FIELDS) and set(FIELDS) - fields == sampling
    doc = (ROOT / "docs/agentic.md").read_text()
    table = doc.split("<!-- fields: anthropic -->", 1)[1].split("\n\n", 2)[1]
    rows = [
        tuple(c.strip().strip("`") for c in r.strip("|").split("|")) for r in table.splitlines()
    ]
    assert rows[2:] == [(n, s, h) for n, s, h in table_rows(FIELDS)]


# ---- requests -> ChatCall ---------------------------------------------------------------------
def test_messages_become_one_chat_conversation(tok: Any) -> None:
    body = {
        "model": "policy",
        "max_tokens": 7,
        "system": [{"type": "text", "text": "Use "}, {"type": "text", "text": "calc.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "6*"}, {"type": "text", "text": "7"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I multiply.", "signature": "s"},
                    {"type": "redacted_thinking", "data": "x"},
                    {"type": "text", "text": "Let me."},
                    {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {"x": "6*7"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "other", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                     "content": [{"type": "text", "text": "no such"}, {"type": "text", "text": " op"}]},
                    {"type": "text", "text": "and now?"},
                ],
            },
            {"role": "assistant", "content": []},
            {"role": "user", "content": "thanks"},
        ],
        "tools": ATOOLS,
        "tool_choice": {"type": "tool", "name": "calc", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 1.0,
        "top_k": 0,
        "metadata": {"user_id": "u"},
    }  # fmt: skip
    call, stream = parse_messages(body, _Session(tok))
    calls = [
        {"id": "toolu_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "6*7"}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "other", "arguments": "{}"}},
    ]  # fmt: skip
    assert call.messages == [
        {"role": "system", "content": "Use calc."},
        {"role": "user", "content": "6*7"},
        {"role": "assistant", "content": "Let me.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "42", "name": "calc"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "no such op", "name": "other"},
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "thanks"},
    ]
    assert call.tools == TOOLS and not stream  # OpenAI's function format, as a chat client's
    assert call.options == CallOptions(
        max_tokens=7,
        stop=("END",),
        tool_choice=ToolChoice("function", "calc"),
        parallel_tool_calls=False,
        sampling={"temperature": 1.0, "top_k": 0},
    )
    for choice, want in [
        ({"type": "auto"}, (ToolChoice("auto"), True)),
        ({"type": "any"}, (ToolChoice("required"), True)),
        ({"type": "none"}, (ToolChoice("none"), True)),
        ({"type": "any", "disable_parallel_tool_use": True}, (ToolChoice("required"), False)),
    ]:
        call, _ = parse_messages({**body, "tool_choice": choice}, _Session(tok))
        assert (call.options.tool_choice, call.options.parallel_tool_calls) == want


@pytest.mark.parametrize(
    ("extra", "param", "match"),
    [
        ({"max_tokens": None}, "max_tokens", "max_tokens: Field required"),
        ({"max_tokens": "9"}, "max_tokens", "must be an integer"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "'role'"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages", "'role'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages", "string or a list"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages",
            "serves a text model",
        ),  # fmt: skip
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages",
            "serves a text model",
        ),  # fmt: skip
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ]
            },
            "messages",
            "this message takes text, tool_result",
        ),  # fmt: skip
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}],
                    }
                ]
            },
            "messages",
            "'input': object",
        ),  # fmt: skip
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages",
            "tool_use_id",
        ),  # fmt: skip
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image"}],
                            }
                        ],
                    }
                ]
            },
            "messages",
            "serves a text model",
        ),  # fmt: skip
        (
            {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages",
            "content block",
        ),  # fmt: skip
        ({"system": [{"type": "image"}]}, "messages", "serves a text model"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools",
            "server tool",
        ),  # fmt: skip
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object"}, "defer_loading": True}]},
            "tools",
            r"\['defer_loading'\]",
        ),  # fmt: skip
        ({"tools": [{"name": "f", "input_schema": {"type": "x"}}]}, "tools", "not a valid tool"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice", "tool_choice must be"),
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice must be"),
        (
            {"tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
            "tool_choice",
            "true or false",
        ),  # fmt: skip
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}],
                    }
                ]
            },
            "messages",
            "is_error",
        ),  # fmt: skip
        ({"stop_sequences": [""]}, "stop_sequences", "non-empty"),
        ({"temperature": "hot"}, "temperature", "must be a number"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 2000}},
            "thinking",
            "has no reasoning block",
        ),  # fmt: skip
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking", "at least 1024"),
        ({"thinking": {"type": "adaptive"}}, "thinking", "has no reasoning block"),
        ({"thinking": {"type": "between_tools"}}, "thinking", "not served"),
        ({"thinking": {"type": "on"}}, "thinking", "thinking must be"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {}}}},
            "output_config",
            "constrained decoding",
        ),  # fmt: skip
        ({"speed": "fast"}, "speed", "one speed"),
        ({"container": "c"}, "container", "container"),
        ({"frequency_penalty": 0.1}, "frequency_penalty", "Unrecognized request argument"),
    ],
)
def test_malformed_or_refused_requests_are_400_naming_the_field(
    tok: Any, extra: dict[str, Any], param: str, match: str
) -> None:
    body = {"model": "policy", "max_tokens": 2048, "messages": [{"role": "user", "content": "x"}]}
    body = {k: v for k, v in (body | extra).items() if v is not None}
    with pytest.raises(EndpointError, match=match) as err:
        parse_messages(body, _Session(tok))
    assert err.value.status == 400 and err.value.param == param


def test_thinking_is_what_the_template_does(tok: Any, reasoning_tok: Any) -> None:
    body = {"model": "policy", "max_tokens": 2048, "messages": [{"role": "user", "content": "x"}]}
    for kind in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        parse_messages({**body, "thinking": kind}, _Session(reasoning_tok))
    parse_messages({**body, "thinking": {"type": "disabled"}}, _Session(tok))
    with pytest.raises(EndpointError, match="disabled cannot be honoured"):
        parse_messages({**body, "thinking": {"type": "disabled"}}, _Session(reasoning_tok))
    with pytest.raises(EndpointError, match="less than max_tokens"):
        too_big = {"type": "enabled", "budget_tokens": 4096}
        parse_messages({**body, "thinking": too_big}, _Session(reasoning_tok))


# ---- Reply -> message and events --------------------------------------------------------------
def _reply(**kw: Any) -> Reply:
    base: dict[str, Any] = dict(
        content="Let me.",
        reasoning="I multiply.",
        tool_calls=(ToolCall("calc", {"x": "6*7"}, "call_0_0"),),
        finish="tool_calls",
        stop_sequence=None,
        completion=Completion(0, [5, 6, 7], [-0.1, -0.2, -0.3], "stop", 0),
        prompt_tokens=10,
        max_tokens=80,
        capped_from=None,
        overridden=(),
        call_index=1,
        session="abc",
    )
    return Reply(**(base | kw))


def test_a_reply_as_a_message_and_its_event_stream() -> None:
    body = message_body(_reply(), "policy")
    signature = body["content"][0].pop("signature")
    assert isinstance(signature, str) and signature
    assert body == {
        "id": "msg_abc_1",
        "type": "message",
        "role": "assistant",
        "model": "policy",
        "content": [
            {"type": "thinking", "thinking": "I multiply."},
            {"type": "text", "text": "Let me."},
            {"type": "tool_use", "id": "toolu_0_0", "name": "calc", "input": {"x": "6*7"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    stops = [
        (dict(tool_calls=(), finish="length"), "max_tokens", None),
        (dict(tool_calls=(), finish="stop", stop_sequence="END"), "stop_sequence", "END"),
        (dict(tool_calls=(), finish="stop"), "end_turn", None),
    ]
    for kw, reason, sequence in stops:
        out = message_body(_reply(**kw), "policy")
        assert (out["stop_reason"], out["stop_sequence"]) == (reason, sequence)
    events = message_events(_reply(), "policy")
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events] == [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 3}


def test_errors_in_anthropics_shape() -> None:
    overflow = EndpointError(
        400,
        "This model's maximum context length is 100 tokens...",
        "context_length_exceeded",
        detail={"prompt_tokens": 90, "max_tokens": 80, "limit": 100},
    )
    body = error_body(overflow)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt is too long: 170 tokens > 100 maximum")
    for status, kind in [
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ]:
        assert error_body(EndpointError(status, "x"))["error"] == {"type": kind, "message": "x"}


# ---- the anthropic client ---------------------------------------------------------------------
def test_a_tool_conversation_is_token_identical_to_chat_completions(
    tok: Any, endpoint: Any
) -> None:
    import openai

    chat, _ = open_session(tok, endpoint)
    messages_api, _ = open_session(tok, endpoint)
    c = openai.OpenAI(base_url=endpoint.base_url(chat), api_key="x", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": "Use calc."},
        {"role": "user", "content": "12*34"},
    ]
    out = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    call = out.choices[0].message.tool_calls[0]
    messages += [
        out.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": "408"},
    ]
    c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    first = create(endpoint, messages_api, "12*34", system="Use calc.")
    [use] = first.content
    assert (first.stop_reason, use.type, use.name, use.input) == (
        "tool_use",
        "tool_use",
        "calc",
        {"x": "12*34"},
    )
    conversation = [
        {"role": "user", "content": "12*34"},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "408"}]},
    ]  # fmt: skip
    second = create(endpoint, messages_api, messages=conversation, system="Use calc.")
    assert [(b.type, b.text) for b in second.content] == [("text", ANSWER)]
    assert second.stop_reason == "end_turn"
    assert second.usage.output_tokens == len(done(messages_api).turns[1].response_ids)
    assert second.usage.input_tokens == len(done(messages_api).turns[1].prompt_ids)
    assert trace(messages_api) == trace(chat) and len(done(messages_api).segments) == 0


def test_streaming_gives_the_same_reply_and_trajectory(tok: Any, endpoint: Any) -> None:
    plain, _ = open_session(tok, endpoint)
    streamed, _ = open_session(tok, endpoint)
    helper, _ = open_session(tok, endpoint)
    out = create(endpoint, plain, "12*34")
    events = list(create(endpoint, streamed, "12*34", stream=True))
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[1].content_block.id == out.content[0].id
    assert json.loads(events[2].delta.partial_json) == out.content[0].input
    assert events[4].delta.stop_reason == "tool_use"
    assert trace(plain) == trace(streamed)
    with client(endpoint, helper).messages.stream(
        model="policy", max_tokens=80, messages=[{"role": "user", "content": "chat"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == ANSWER and final.stop_reason == "end_turn"
    s, _ = open_session(tok, endpoint)  # the wire format: an event line, then its data line
    path = endpoint.base_url(s).split(str(endpoint.port), 1)[1].removesuffix("/v1")
    body = {"model": "policy", "max_tokens": 9, "messages": [{"role": "user", "content": "chat"}]}
    status, kind, data = raw(
        endpoint, "POST", path + "/v1/messages", json.dumps(body | {"stream": True}).encode()
    )
    assert status == 200 and kind == "text/event-stream"
    first = data.decode().split("\n\n")[0].splitlines()
    assert (
        first[0] == "event: message_start" and json.loads(first[1][6:])["type"] == "message_start"
    )


def test_async_client_and_headers(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint)
    base = endpoint.base_url(s).removesuffix("/v1")

    async def main() -> Any:
        async with anthropic.AsyncAnthropic(
            base_url=base, api_key="any-key", default_headers={"anthropic-version": "2099-01-01"}
        ) as c:
            return await c.messages.create(
                model="claude-sonnet-4-5",  # an alias the recipe declares
                max_tokens=80,
                messages=[{"role": "user", "content": "chat"}],
            )

    out = asyncio.run(main())
    assert out.content[0].text == ANSWER and out.model == "claude-sonnet-4-5"
    s, _ = open_session(tok, endpoint)  # a bearer token instead of x-api-key: the same
    bearer = anthropic.Anthropic(
        base_url=endpoint.base_url(s).removesuffix("/v1"), auth_token="tok", max_retries=0
    )
    out = bearer.messages.create(
        model="policy", max_tokens=80, messages=[{"role": "user", "content": "chat"}]
    )
    assert out.content[0].text == ANSWER


def test_thinking_blocks_carry_the_models_reasoning_and_come_back(
    reasoning_tok: Any, endpoint: Any
) -> None:
    s = thinking_session(reasoning_tok, endpoint)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    first = create(endpoint, s, "think", max_tokens=2000, thinking=thinking)
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == "I multiply." and first.content[0].signature
    assert first.model_extra["roll"]["max_tokens"]["applied"] == 200
    use = first.content[1]
    conversation = [
        {"role": "user", "content": "think"},
        {"role": "assistant", "content": first.content},  # the thinking block sent back
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
    ]  # fmt: skip
    second = create(endpoint, s, messages=conversation, max_tokens=2000, thinking=thinking)
    assert second.content[0].text == ANSWER  # history strict: the call continued
    generated = reasoning_tok.decode(done(s).turns[0].response_ids, skip_special_tokens=True)
    assert generated.startswith(THINK)  # the trace keeps the reasoning ids generated
    # streamed, and sent back without its thinking block: the same assistant message
    streamed = thinking_session(reasoning_tok, endpoint)
    with client(endpoint, streamed).messages.stream(
        model="policy", max_tokens=200, tools=ATOOLS, messages=conversation[:1]
    ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds == ["thinking_delta", "signature_delta", "input_json_delta"]
    assert final.content[0].thinking == "I multiply."
    conversation[1] = {"role": "assistant", "content": final.content[1:]}
    again = create(endpoint, streamed, messages=conversation)
    assert again.content[0].text == ANSWER and trace(streamed) == trace(s)


# ---- each row of the table --------------------------------------------------------------------
def test_honoured_rows_change_the_reply(tok: Any, endpoint: Any) -> None:
    s, model = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", max_tokens=5)
    assert (out.stop_reason, out.content[0].text, out.usage.output_tokens) == (
        "max_tokens",
        "The a",
        5,
    )
    assert model.params[-1].max_new_tokens == 5
    s, model = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", stop_sequences=["END", "zzz"])
    assert model.params[-1].stop == ("END", "zzz")
    assert (out.stop_reason, out.stop_sequence, out.content[0].text) == (
        "stop_sequence",
        "END",
        "The answer is 42.",
    )
    s, _ = open_session(tok, endpoint)
    out = create(endpoint, s, "6*7", tool_choice={"type": "none"})  # the model writes a call
    assert [b.type for b in out.content] == ["text"] and out.stop_reason == "end_turn"
    s, _ = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", tool_choice={"type": "any"})  # it would answer in text
    assert [(b.type, b.name) for b in out.content] == [("tool_use", "calc")]
    s, _ = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", tool_choice={"type": "tool", "name": "other"})
    assert [(b.type, b.name) for b in out.content] == [("tool_use", "other")]
    s, _ = open_session(tok, endpoint, max_new_tokens=200, max_context=1024)
    assert len(create(endpoint, s, "two", max_tokens=200).content) == 2
    s, model = open_session(tok, endpoint, max_new_tokens=200, max_context=1024)
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    out = create(endpoint, s, "two", max_tokens=200, tool_choice=choice)
    assert len(out.content) == 1 and model.params[-1].stop == ("</tool_call>",)
    s, _ = open_session(tok, endpoint)
    with pytest.raises(anthropic.BadRequestError, match=r"temperature=0\.0.*agent_sampling"):
        create(endpoint, s, "chat", extra_body={"temperature": 0.0})
    s, model = open_session(tok, endpoint, agent_sampling="recipe")
    out = create(endpoint, s, "chat", extra_body={"temperature": 0.0, "top_k": 5})
    assert out.model_extra["roll"]["sampling_overridden"] == ["temperature", "top_k"]


def test_refused_rows_get_their_400_and_accepted_rows_change_nothing(
    tok: Any, endpoint: Any
) -> None:
    asks = {
        "output_config": {"effort": "low"},
        "container": "c",
        "inference_geo": "us",
        "speed": "fast",
        "diagnostics": {"previous_message_id": "m"},
    }
    refused = [n for n, _, _ in table_rows(FIELDS) if FIELDS[n].status == "refused"]
    assert sorted(asks) == sorted(refused)
    for name, value in asks.items():
        s, _ = open_session(tok, endpoint)
        with pytest.raises(anthropic.BadRequestError) as err:
            create(endpoint, s, "chat", extra_body={name: value})
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert err.value.body["error"]["message"].startswith(name) and done(s).turns == []
    accepted = {
        "metadata": {"user_id": "u"},
        "cache_control": {"type": "ephemeral"},
        "service_tier": "standard_only",
        "user_profile_id": "p",
        "workspace_id": "w",
        "output_config": {},
        "speed": "standard",
        "temperature": 1.0,
        "top_p": 1.0,
    }
    s, _ = open_session(tok, endpoint)
    assert create(endpoint, s, "chat", extra_body=accepted).content[0].text == ANSWER
    with pytest.raises(anthropic.BadRequestError, match="Unrecognized request argument supplied"):
        create(endpoint, open_session(tok, endpoint)[0], extra_body={"foo": 1})


def test_errors_clients_act_on_never_5xx(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint, max_context=100)
    with pytest.raises(anthropic.BadRequestError) as err:
        create(endpoint, s, "y" * 200, max_tokens=20)
    assert "prompt is too long: " in err.value.message and "> 100 maximum" in err.value.message
    assert s.context_full and done(s).turns == []
    s, _ = open_session(tok, endpoint)
    with pytest.raises(anthropic.NotFoundError) as err:
        create(endpoint, s, "chat", model="claude-opus-4-5")
    assert err.value.body["error"]["type"] == "not_found_error"
    path = endpoint.base_url(s).split(str(endpoint.port), 1)[1] + "/messages"
    ok = {"model": "policy", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
    cases = [
        b"[1, 2]",
        b"{not json",
        b'{"model": "policy", "max_tokens": 9, "messages": "\xff\xfe"}',
        json.dumps({**ok, "max_tokens": None}).encode(),
        json.dumps({**ok, "messages": [{"role": "user", "content": [None]}]}).encode(),
        json.dumps(
            {**ok, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}
        ).encode(),
        json.dumps({**ok, "system": 5}).encode(),
        json.dumps({**ok, "tools": [3]}).encode(),
        json.dumps({**ok, "tool_choice": {"type": "tool", "name": 3}}).encode(),
        json.dumps({**ok, "thinking": "on"}).encode(),
        json.dumps({**ok, "stop_sequences": "END"}).encode(),  # a string: served as one stop
    ]
    for data in cases[:-1]:
        status, kind, text = raw(endpoint, "POST", path, data, **{"x-api-key": "k"})
        body = json.loads(text)
        assert status == 400 and kind == "application/json", (data, status, text)
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert raw(endpoint, "POST", path, cases[-1])[0] == 200
    litellm = pytest.importorskip("litellm")
    s, _ = open_session(tok, endpoint, max_context=100)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model="anthropic/policy",
            api_base=endpoint.base_url(s).removesuffix("/v1") + "/v1/messages",
            api_key="roll",
            max_tokens=20,
            messages=[{"role": "user", "content": "y" * 200}],
        )


def test_claude_code_style_tool_results_with_text_continue_and_tokens_are_counted(
    tok: Any, endpoint: Any
) -> None:
    """A user message holding tool results and then text (Claude Code's system reminders)
    continues the conversation: the prompt is the trace plus the template's ids for the tool
    message and the user message, no new segment; count_tokens says the size of that prompt
    before the call, without recording anything."""
    s, _ = open_session(tok, endpoint)
    first = create(endpoint, s, "12*34", system="Use calc.")
    [use] = first.content
    conversation = [
        {"role": "user", "content": "12*34"},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "408"},
            {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
        ]},
    ]  # fmt: skip
    c = client(endpoint, s)
    counted = c.messages.count_tokens(
        model="policy", messages=conversation, system="Use calc.", tools=ATOOLS
    )
    assert len(done(s).turns) == 1  # counting records nothing
    second = create(endpoint, s, messages=conversation, system="Use calc.")
    traj = done(s)
    assert counted.input_tokens == second.usage.input_tokens == len(traj.turns[1].prompt_ids)
    assert traj.segments == [] and len(traj.turns) == 2
    before = traj.turns[0].prompt_ids + traj.turns[0].response_ids
    added = traj.turns[1].prompt_ids[len(before) :]
    want = "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>user\n<system-reminder>be brief"
    assert tok.decode(added).startswith(want) and traj.turns[1].prompt_ids[: len(before)] == before
    # an unknown session on /v1/messages: Anthropic's error shape (the client's NotFoundError)
    stale = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{endpoint.port}/s/nosuchsession", api_key="x", max_retries=0
    )
    with pytest.raises(anthropic.NotFoundError) as err:
        stale.messages.create(
            model="policy", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert (
        err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    )
