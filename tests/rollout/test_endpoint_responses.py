"""The OpenAI Responses API on the agent endpoint: hand-written bodies to ChatCalls, replies to
response objects and event streams, then the real ``openai`` client (``responses.create``, sync,
async and streaming, and ``responses.stream``) against a real endpoint with the scripted model of
test_endpoint_chat.py (a ``calc`` call for a question, two calls for "two", text for "chat" and
after a tool result; token ``i`` has log-prob ``-(i + 1) / 100``).

The same conversation through the Responses API (items sent back, or ``previous_response_id``)
and through Chat Completions gives the same trajectory, id for id."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from roll_core.backends.infer import Completion
from roll_core.envs.tool_parsers import ToolCall
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.models.loading import use_chat_template
from roll_core.rollout.agentic.endpoint import AgentEndpoint, AgentSession, EndpointError, Reply
from roll_core.rollout.agentic.endpoint.calls import CallOptions, ToolChoice
from roll_core.rollout.agentic.endpoint.fields import table_rows
from roll_core.rollout.agentic.endpoint.responses import (
    FIELDS,
    KEPT,
    _Request,
    parse_responses,
    reasoning_tokens,
    response_body,
    response_events,
)
from tests.rollout.test_endpoint_chat import TEMPLATE, TOOLS, done, open_session, raw

ROOT = Path(__file__).resolve().parents[2]
RTOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses' flat format
LOGPROBS = "message.output_text.logprobs"
ENCRYPTED = "reasoning.encrypted_content"
ANSWER = "The answer is 42. END of story"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tokenizer = load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("m"))))
    use_chat_template(tokenizer, TEMPLATE)
    return tokenizer


@pytest.fixture()
def endpoint() -> Any:
    ep = AgentEndpoint(port=0, model="builtin:tiny-qwen3", aliases=("gpt-4o",), read_timeout_s=1)
    yield ep
    ep.close()


def client(endpoint: AgentEndpoint, s: AgentSession) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url(s), api_key="roll", max_retries=0)


def create(endpoint: AgentEndpoint, s: AgentSession, input: Any = "6*7", **kw: Any) -> Any:
    kw.setdefault("tools", RTOOLS)
    return client(endpoint, s).responses.create(model="policy", input=input, **kw)


def trace(s: AgentSession) -> tuple[list[int], list[int], list[float]]:
    t = done(s).trace
    return list(t.ids), list(t.mask), list(t.log_probs)


class _Session:
    """What parse_responses reads of a session (its token, for previous_response_id)."""

    token = "t0"
    closed = False


# ---- the field table --------------------------------------------------------------------------
def test_docs_show_the_table_and_it_has_every_field_of_the_client() -> None:
    from openai.types.responses import response_create_params as r

    assert set(r.ResponseCreateParamsBase.__annotations__) | {"stream"} == set(FIELDS)
    doc = (ROOT / "docs/agentic.md").read_text()
    table = doc.split("<!-- fields: responses -->", 1)[1].split("\n\n", 2)[1]
    rows = [
        tuple(c.strip().strip("`") for c in r.strip("|").split("|")) for r in table.splitlines()
    ]
    assert rows[2:] == [(n, s, h) for n, s, h in table_rows(FIELDS)]


# ---- requests -> ChatCall ---------------------------------------------------------------------
def test_input_items_become_one_chat_conversation() -> None:
    body = {
        "model": "policy",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use calc."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "6*"}, {"type": "input_text", "text": "7"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Let me.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": '{"x": "6*7"}'},
            {"type": "function_call", "call_id": "c2", "name": "other", "arguments": "{}", "id": "fc"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
            {"type": "reasoning", "id": "rs_2", "summary": []},  # a turn of reasoning only
            {"role": "user", "content": "thanks"},
        ],
        "tools": RTOOLS,
        "tool_choice": {"type": "function", "name": "calc"},
        "parallel_tool_calls": False,
        "max_output_tokens": 7,
        "include": [LOGPROBS],
        "top_logprobs": 2,
        "temperature": 1.0,
        "metadata": {"k": "v"},
        "store": False,
    }  # fmt: skip
    call, request = parse_responses(body, _Session())
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "6*7"}'}},
        {"id": "c2", "type": "function", "function": {"name": "other", "arguments": "{}"}},
    ]
    assert call.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use calc."},
        {"role": "user", "content": "6*7"},
        {"role": "assistant", "content": "Let me.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "calc"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok", "name": "other"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "thanks"},
    ]
    assert call.tools == TOOLS  # OpenAI's function format, exactly as a chat client sends it
    assert call.options == CallOptions(
        max_tokens=7,
        tool_choice=ToolChoice("function", "calc"),
        parallel_tool_calls=False,
        logprobs=True,
        top_logprobs=2,
        sampling={"temperature": 1.0},
    )
    assert request.conversation == call.messages[1:] and not request.store
    call, _ = parse_responses({"model": "policy", "input": "hi"}, _Session())
    assert call.messages == [{"role": "user", "content": "hi"}] and call.tools is None
    assert call.options == CallOptions()


@pytest.mark.parametrize(
    ("extra", "param", "match"),
    [
        ({"input": 3}, "input", "a string or a list of input items"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [3]}, "input", r"input\[0\] must be an object"),
        ({"input": [{"role": "boss", "content": "x"}]}, "input", r"input\[0\].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "text"),
        ({"input": [{"role": "user", "content": "x", "foo": 1}]}, "input", r"\['foo'\]"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input",
            "function_call",
        ),  # fmt: skip
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input", "web_search_call"),
        ({"tools": [{"type": "web_search"}]}, "tools", "built-in tools"),
        ({"tools": [{"type": "function", "name": "f", "foo": 1}]}, "tools", r"\['foo'\]"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "x"}}]},
            "tools",
            "not a valid tool",
        ),  # fmt: skip
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "hosted-tool"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"include": ["file_search_call.results"]}, "include", "not served"),
        ({"include": "x"}, "include", "list of strings"),
        ({"top_logprobs": 2}, "top_logprobs", "needs include"),
        ({"top_logprobs": 21, "include": [LOGPROBS]}, "top_logprobs", "between 0 and 20"),
        ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream: true"),
        ({"metadata": {"a": 1}}, "metadata", "string values"),
        ({"temperature": "hot"}, "temperature", "must be a number"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id", "not found"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
            "text",
            "constrained decoding",
        ),  # fmt: skip
        ({"reasoning": {"effort": "high"}}, "reasoning", "not served"),
        ({"truncation": "auto"}, "truncation", "cannot do"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "Unrecognized request argument"),
    ],
)
def test_malformed_or_refused_requests_are_400_naming_the_field(
    extra: dict[str, Any], param: str, match: str
) -> None:
    body = {"model": "policy", "input": "hi", **extra}
    with pytest.raises(EndpointError, match=match) as err:
        parse_responses(body, _Session())
    assert err.value.status == 400 and err.value.param == param


# ---- Reply -> response object and events ------------------------------------------------------
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


def test_a_reply_as_a_response_object_and_its_event_stream() -> None:
    request = _Request({"model": "policy", "input": "x", "include": [LOGPROBS]}, [])
    body = response_body(_reply(), "policy", request)
    assert body["id"] == "resp_abc_1" and body["status"] == "completed"
    assert body["output"] == [
        {
            "type": "reasoning",
            "id": "rs_abc_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "I multiply."}],
            "status": "completed",
        },
        {
            "type": "message",
            "id": "msg_abc_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me.", "annotations": [], "logprobs": []}],
        },
        {
            "type": "function_call",
            "id": "fc_abc_1_0",
            "call_id": "call_0_0",
            "name": "calc",
            "arguments": '{"x": "6*7"}',
            "status": "completed",
        },
    ]  # fmt: skip
    assert body["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }
    events = response_events(_reply(), "policy", request)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "reasoning_text.delta", "reasoning_text.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]  # fmt: skip
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    assert events[-1]["response"]["output"] == body["output"]

    class Bytes:  # one id per character, as the built-in tokenizer has one per byte
        @staticmethod
        def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(map(chr, ids))

    thought = _reply(
        completion=Completion(0, [ord(c) for c in "<think>ab</think>cd"], [0.0] * 19, "stop", 0)
    )
    assert (
        reasoning_tokens(thought, Bytes()) == 17
        and reasoning_tokens(_reply(reasoning=None), Bytes()) == 0
    )
    encrypted = _Request({"model": "policy", "input": "x", "include": [ENCRYPTED]}, [])
    reasoning = response_body(_reply(), "policy", encrypted)["output"][0]
    assert reasoning["encrypted_content"] == "I multiply."  # its text: roll has no secret
    # cut by max_output_tokens: incomplete, and the stream ends with response.incomplete
    cut = _reply(content="The a", reasoning=None, tool_calls=(), finish="length")
    body = response_body(cut, "policy", request)
    assert (body["status"], body["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert body["output"][0]["status"] == "incomplete"
    assert response_events(cut, "policy", request)[-1]["type"] == "response.incomplete"


# ---- the openai client ------------------------------------------------------------------------
def test_a_tool_conversation_is_token_identical_to_chat_completions(
    tok: Any, endpoint: Any
) -> None:
    chat, _ = open_session(tok, endpoint)
    items, _ = open_session(tok, endpoint)
    chained, _ = open_session(tok, endpoint)
    # Chat Completions
    c = client(endpoint, chat)
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
    # the Responses API, the items sent back
    first = create(
        endpoint, items, [{"role": "user", "content": "12*34"}], instructions="Use calc."
    )
    [fc] = first.output
    assert (fc.type, fc.name, json.loads(fc.arguments), first.output_text) == (
        "function_call",
        "calc",
        {"x": "12*34"},
        "",
    )
    result = {"type": "function_call_output", "call_id": fc.call_id, "output": "408"}
    second = create(
        endpoint,
        items,
        [{"role": "user", "content": "12*34"}, *first.output, result],
        instructions="Use calc.",
    )
    assert second.output_text == ANSWER and second.status == "completed"
    assert second.usage.output_tokens == len(done(items).turns[1].response_ids)
    # the Responses API, previous_response_id
    first = create(endpoint, chained, "12*34", instructions="Use calc.")
    result["call_id"] = first.output[0].call_id
    second = create(
        endpoint, chained, [result], instructions="Use calc.", previous_response_id=first.id
    )
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    assert trace(items) == trace(chat) == trace(chained)
    assert [len(done(s).segments) for s in (chat, items, chained)] == [0, 0, 0]
    assert all(t.action_is_valid for t in done(items).turns)


def test_previous_response_id_is_kept_for_the_episode_only(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint, history="strict")
    first = create(endpoint, s, "chat", instructions="Be brief.")
    second = create(
        endpoint, s, "thanks", previous_response_id=first.id, instructions="Be brief.", store=False
    )
    assert second.output[0].name == "calc" and len(done(s).turns) == 2  # it continued
    with pytest.raises(openai.BadRequestError) as err:  # store: false -> not kept
        create(endpoint, s, "more", previous_response_id=second.id)
    assert err.value.code == "previous_response_not_found"
    other, _ = open_session(tok, endpoint)
    with pytest.raises(openai.BadRequestError, match="not found"):  # another episode's
        create(endpoint, other, "more", previous_response_id=first.id)
    # instructions are not carried over (as in OpenAI's API): without them the conversation
    # is another one (history strict: 400 naming the message)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\] differs"):
        create(endpoint, s, "more", previous_response_id=first.id)
    endpoint.close_session(s)
    with pytest.raises(openai.NotFoundError):
        create(endpoint, s, "more", previous_response_id=first.id)
    assert s.token in KEPT.by_session
    create(endpoint, other, "chat")  # storing a response drops the closed sessions' ones
    assert s.token not in KEPT.by_session and other.token in KEPT.by_session


def test_streaming_gives_the_same_reply_and_trajectory(tok: Any, endpoint: Any) -> None:
    plain, _ = open_session(tok, endpoint)
    streamed, _ = open_session(tok, endpoint)
    helper, _ = open_session(tok, endpoint)
    out = create(endpoint, plain, "12*34")
    events = list(create(endpoint, streamed, "12*34", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert final.output[0].arguments == out.output[0].arguments
    assert final.output[0].call_id == out.output[0].call_id
    assert trace(plain) == trace(streamed)
    with client(endpoint, helper).responses.stream(
        model="policy", input="chat", tools=RTOOLS
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        response = stream.get_final_response()
    assert "".join(texts) == response.output_text == ANSWER
    # the wire format: an event line, then its data line
    s, _ = open_session(tok, endpoint)
    path = endpoint.base_url(s).split(str(endpoint.port), 1)[1] + "/responses"
    status, kind, text = raw(
        endpoint,
        "POST",
        path,
        json.dumps({"model": "policy", "input": "chat", "stream": True}).encode(),
    )
    assert status == 200 and kind == "text/event-stream"
    first = text.decode().split("\n\n")[0].splitlines()
    assert (
        first[0] == "event: response.created" and json.loads(first[1][6:])["sequence_number"] == 0
    )


def test_async_client(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint)

    async def main() -> Any:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url(s), api_key="x") as c:
            return await c.responses.create(model="policy", input="chat")

    assert asyncio.run(main()).output_text == ANSWER


# ---- each row of the table --------------------------------------------------------------------
def test_honoured_rows_change_the_reply(tok: Any, endpoint: Any) -> None:
    s, model = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", max_output_tokens=5)
    assert (out.status, out.incomplete_details.reason, out.output_text) == (
        "incomplete",
        "max_output_tokens",
        "The a",
    )
    assert model.params[-1].max_new_tokens == 5 and out.usage.output_tokens == 5
    s, model = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", max_output_tokens=1000)
    assert (
        model.params[-1].max_new_tokens == 80
        and out.model_extra["roll"]["max_tokens"]["applied"] == 80
    )
    s, _ = open_session(tok, endpoint)
    out = create(endpoint, s, "6*7", tool_choice="none")  # the model writes a call anyway
    assert [i.type for i in out.output] == ["message"] and "<tool_call>" in out.output_text
    s, _ = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", tool_choice="required")  # it would answer in text
    assert [(i.type, i.name) for i in out.output] == [("function_call", "calc")]
    s, _ = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", tool_choice={"type": "function", "name": "other"})
    assert [(i.type, i.name) for i in out.output] == [("function_call", "other")]
    s, _ = open_session(tok, endpoint, max_new_tokens=200, max_context=1024)
    assert len(create(endpoint, s, "two").output) == 2
    s, model = open_session(tok, endpoint, max_new_tokens=200, max_context=1024)
    out = create(endpoint, s, "two", parallel_tool_calls=False)
    assert len(out.output) == 1 and model.params[-1].stop == ("</tool_call>",)
    assert out.parallel_tool_calls is False
    s, model = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", include=[LOGPROBS], top_logprobs=2, max_output_tokens=3)
    [part] = out.output[0].content
    assert [(t.token, t.logprob) for t in part.logprobs] == [
        ("T", -0.01),
        ("h", -0.02),
        ("e", -0.03),
    ]
    assert [[a.logprob for a in t.top_logprobs] for t in part.logprobs] == [
        [0.0, -0.1],
        [-0.1, -0.2],
        [-0.2, -0.3],
    ]
    s, model = open_session(tok, endpoint)
    out = create(endpoint, s, "chat", metadata={"run": "a"}, user="u", store=True)
    assert out.metadata == {"run": "a"} and model.params[-1].top_logprobs == 0


def test_refused_rows_get_their_400_and_inert_values_pass(tok: Any, endpoint: Any) -> None:
    asks = {
        "text": {"format": {"type": "json_object"}},
        "reasoning": {"effort": "low"},
        "truncation": "auto",
        "max_tool_calls": 3,
        "background": True,
        "background_options": {},
        "conversation": "conv_1",
        "context_management": [{"type": "compaction"}],
        "prompt": {"id": "pmpt_1"},
        "service_tier": "flex",
        "moderation": {},
        "image": {},
        "access_programs": {},
        "prompt_cache_options": {},
        "prompt_cache_retention": "24h",
    }
    refused = [n for n, _, _ in table_rows(FIELDS) if FIELDS[n].status == "refused"]
    assert sorted(asks) == sorted(refused)
    for name, value in asks.items():
        s, _ = open_session(tok, endpoint)
        with pytest.raises(openai.BadRequestError) as err:
            create(endpoint, s, "chat", extra_body={name: value})
        assert err.value.body["param"] == name and done(s).turns == [], name
    s, _ = open_session(tok, endpoint)
    with pytest.raises(openai.BadRequestError, match=r"temperature=0\.0.*agent_sampling"):
        create(endpoint, s, "chat", temperature=0.0)
    inert = {
        "text": {"format": {"type": "text"}},
        "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled",
        "background": False,
        "service_tier": "auto",
        "temperature": 1.0,
        "top_p": 1.0,
        "safety_identifier": "x",
        "prompt_cache_key": "k",
    }
    s, _ = open_session(tok, endpoint)
    assert create(endpoint, s, "chat", extra_body=inert).output_text == ANSWER
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: foo"):
        create(endpoint, open_session(tok, endpoint)[0], extra_body={"foo": 1})


def test_errors_in_openai_shape_never_5xx(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint)
    path = endpoint.base_url(s).split(str(endpoint.port), 1)[1] + "/responses"
    cases = [
        b"[1, 2]",
        b'"hello"',
        b"{not json",
        b'{"model": "policy", "input": "\xff\xfe"}',
        json.dumps({"input": "x"}).encode(),
        json.dumps({"model": "policy"}).encode(),
        json.dumps({"model": "policy", "input": [{"type": "function_call_output"}]}).encode(),
        json.dumps({"model": "policy", "input": "x", "tools": "calc"}).encode(),
        json.dumps({"model": "policy", "input": "x", "include": [None]}).encode(),
        json.dumps({"model": "policy", "input": [{"role": "user", "content": [None]}]}).encode(),
    ]
    for data in cases:
        status, kind, text = raw(endpoint, "POST", path, data)
        body = json.loads(text)
        assert status == 400 and kind == "application/json", (data, status, text)
        assert set(body["error"]) == {"message", "type", "param", "code"}
    status, _, text = raw(
        endpoint, "POST", path, json.dumps({"model": "gpt-5", "input": "x"}).encode()
    )
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    s, _ = open_session(tok, endpoint, max_context=100)
    with pytest.raises(openai.BadRequestError) as err:
        create(endpoint, s, "y" * 200)
    assert err.value.code == "context_length_exceeded"
    assert "This model's maximum context length is 100 tokens" in err.value.message
    assert done(s).turns == []
