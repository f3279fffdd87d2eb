"""OpenAI Chat Completions on the agent endpoint, field by field, with the real ``openai`` client
(sync, async, streaming) and ``litellm``, and raw HTTP for what no client sends.

The scripted model (``Scripted``) answers as an engine would: it writes a fixed text for the
prompt (a ``calc`` tool call for a question, two calls for "two", plain text for "chat", the
rest of a call after roll's forced ``<tool_call>`` opening), cut at the call's stop strings and
``max_new_tokens`` exactly as :func:`scripted_limits` cuts it; token ``i`` has log-prob
``-(i + 1) / 100`` and, when asked, ``top_logprobs`` alternatives ``(i, -i)``, ``(i + 1, ...)``.
Every "honoured" row of :data:`FIELDS` changes the reply as docs/agentic.md says; every
"refused" row gets its 400; no malformed request gets a 5xx or holds a server thread.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from roll_core.backends.infer import Completion, SamplingParams
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.models.loading import use_chat_template
from roll_core.rollout.agentic import ChatFormat, Trajectory
from roll_core.rollout.agentic.agent_episode import scripted_limits
from roll_core.rollout.agentic.endpoint import AgentEndpoint, AgentSession
from roll_core.rollout.agentic.endpoint.fields import table_rows
from roll_core.rollout.agentic.endpoint.openai_chat import FIELDS

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = str(ROOT / "examples/agents/chatml-tools.jinja")
CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": "%s"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": "Multiply.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
    for name in ("calc", "other")
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tokenizer = load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("m"))))
    use_chat_template(tokenizer, TEMPLATE)
    return tokenizer


class Scripted:
    """The scripted model (see the module docstring); ``params`` records each call's."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.chat = tok, ChatFormat(tok)
        self.params: list[SamplingParams] = []

    def text(self, prompt: str) -> str:
        if prompt.endswith('"arguments": '):
            return '{"x": "6*7"}}\n</tool_call>'
        if prompt.endswith("<tool_call>\n"):
            return '{"name": "calc", "arguments": {"x": "6*7"}}\n</tool_call>'
        if "<|im_start|>tool\n" in prompt.rsplit("<|im_start|>assistant", 2)[-2]:
            return "The answer is 42. END of story"
        question = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt)[-1]
        if question == "chat":
            return "The answer is 42. END of story"
        if question == "two":
            return CALL % "6*7" + "\n" + CALL % "8*9"
        return CALL % question

    def __call__(
        self, prompt: list[int], turn: int, vision: Any, params: SamplingParams
    ) -> Completion:
        self.params.append(params)
        text = self.text(str(self.tok.decode(prompt)))
        ids = list(self.tok.encode(text, add_special_tokens=False)) + [self.tok.eos_token_id]
        ids, finish = scripted_limits(self.chat, ids, prompt, params)
        logps = [-(i + 1) / 100 for i in range(len(ids))]
        k = params.top_logprobs
        tops = [[(i + j, -(i + j) / 10) for j in range(k)] for i in range(len(ids))] if k else None
        return Completion(turn, ids, logps, finish, 0, top_logprobs=tops)


@pytest.fixture()
def endpoint() -> Any:
    ep = AgentEndpoint(port=0, model="builtin:tiny-qwen3", aliases=("gpt-4o",), read_timeout_s=1)
    yield ep
    ep.close()


def open_session(tok: Any, endpoint: AgentEndpoint, **kw: Any) -> tuple[AgentSession, Scripted]:
    model = Scripted(tok)
    s = AgentSession(
        Trajectory("calc", 0, 0, 0),
        ChatFormat(tok),
        model,
        kw.pop("max_new_tokens", 80),
        kw.pop("max_context", 512),
        "builtin:tiny-qwen3",
        sampling=SamplingParams(max_new_tokens=80, temperature=1.0),
        **kw,
    )
    endpoint.open(s)
    return s, model


def done(s: AgentSession) -> Trajectory:
    """The session's trajectory once its last reply is recorded (right after it reached the
    client, under the session's lock)."""
    with s.lock:
        return s.traj


def client(endpoint: AgentEndpoint, s: AgentSession) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url(s), api_key="roll", max_retries=0)


def ask(endpoint: AgentEndpoint, s: AgentSession, content: str = "6*7", **kw: Any) -> Any:
    messages = [{"role": "user", "content": content}]
    return client(endpoint, s).chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, **kw
    )


# ---- the field table --------------------------------------------------------------------------
def test_docs_show_every_field_of_the_table_and_the_client_knows_no_other() -> None:
    from openai.types.chat import completion_create_params as c

    fields = set(c.CompletionCreateParamsBase.__annotations__) | {"stream"}
    vllm_style = {"top_k", "min_p", "repetition_penalty"}
    assert fields <= set(FIELDS) and set(FIELDS) - fields <= vllm_style
    doc = (ROOT / "docs/agentic.md").read_text()
    table = doc.split("<!-- fields: chat -->", 1)[1].split("\n\n", 2)[1]
    rows = [
        tuple(c.strip().strip("`") for c in r.strip("|").split("|")) for r in table.splitlines()
    ]
    assert rows[2:] == [(n, s, h) for n, s, h in table_rows(FIELDS)]


def test_stream_gives_the_same_reply_and_the_same_trajectory(tok: Any, endpoint: Any) -> None:
    plain, _ = open_session(tok, endpoint)
    streamed, _ = open_session(tok, endpoint)
    out = ask(endpoint, plain, "12*34")
    chunks = list(
        ask(endpoint, streamed, "12*34", stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    )
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    calls = [c for k in chunks if k.choices for c in k.choices[0].delta.tool_calls or []]
    args = "".join(c.function.arguments or "" for c in calls)
    assert calls[0].function.name == "calc" and json.loads(args) == {"x": "12*34"}
    assert calls[0].id == out.choices[0].message.tool_calls[0].id
    # the openai client's stream helper puts the chunks back together
    with client(endpoint, open_session(tok, endpoint)[0]).chat.completions.stream(
        model="policy", messages=[{"role": "user", "content": "chat"}]
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "The answer is 42. END of story"
    for a, b in ((done(plain), done(streamed)),):
        assert (a.trace.ids, a.trace.mask, a.trace.log_probs) == (
            b.trace.ids,
            b.trace.mask,
            b.trace.log_probs,
        )


def test_async_client_and_litellm_streaming(tok: Any, endpoint: Any) -> None:
    litellm = pytest.importorskip("litellm")
    s, _ = open_session(tok, endpoint)

    async def main() -> Any:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url(s), api_key="x") as c:
            return await c.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "chat"}]
            )

    assert asyncio.run(main()).choices[0].message.content == "The answer is 42. END of story"
    s2, _ = open_session(tok, endpoint)
    messages = [{"role": "user", "content": "12*34"}]
    stream = litellm.completion(
        model="openai/policy",
        api_base=endpoint.base_url(s2),
        api_key="roll",
        messages=messages,
        tools=TOOLS,
        stream=True,
    )
    chunks = list(stream)
    reply = litellm.stream_chunk_builder(chunks, messages=messages)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"x": "12*34"}
    assert len(done(s2).turns) == 1 and done(s2).turns[0].action_is_valid


def test_max_tokens_and_stop(tok: Any, endpoint: Any) -> None:
    s, model = open_session(tok, endpoint)
    out = ask(endpoint, s, "chat", max_tokens=5)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert model.params[-1].max_new_tokens == 5 and out.choices[0].message.content == "The a"
    s, model = open_session(tok, endpoint)
    out = ask(endpoint, s, "chat", max_completion_tokens=1000)  # above the recipe's 80: capped
    assert model.params[-1].max_new_tokens == 80
    assert out.model_extra["roll"]["max_tokens"] == {
        "requested": 1000,
        "applied": 80,
        "reason": "capped by the recipe's rollout.max_new_tokens",
    }
    s, model = open_session(tok, endpoint)
    out = ask(endpoint, s, "chat", stop=["END", "zzz"])
    assert model.params[-1].stop == ("END", "zzz")
    assert out.choices[0].message.content == "The answer is 42."  # the stop string excluded
    assert out.choices[0].finish_reason == "stop"
    # the trained ids are the ids generated, the stop string's included (no eos)
    generated = done(s).trace.ids[-done(s).turns[0].response_ids.__len__() :]
    assert tok.decode(generated) == "The answer is 42. END"


def test_tool_choice_and_parallel_tool_calls(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint)
    out = ask(endpoint, s, "6*7", tool_choice="none")  # the model writes a call anyway
    assert (
        out.choices[0].message.tool_calls is None
        and "<tool_call>" in out.choices[0].message.content
    )
    assert not done(s).turns[0].action_is_valid
    s, _ = open_session(tok, endpoint)
    out = ask(endpoint, s, "chat", tool_choice="required")  # would answer in text
    [call] = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calc", {"x": "6*7"})
    forced = list(tok.encode("<tool_call>\n", add_special_tokens=False))
    turn = done(s).turns[0]
    assert turn.prompt_ids[-len(forced) :] == forced  # roll's opening: context, not trained
    assert done(s).trace.mask[len(turn.prompt_ids) - len(forced) : len(turn.prompt_ids)] == [
        0
    ] * len(forced)
    s, _ = open_session(tok, endpoint)
    named = {"type": "function", "function": {"name": "other"}}
    out = ask(endpoint, s, "chat", tool_choice=named)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "other" and json.loads(call.function.arguments) == {"x": "6*7"}
    s, _ = open_session(tok, endpoint)
    with pytest.raises(openai.BadRequestError, match="not among the declared tools"):
        ask(endpoint, s, tool_choice={"type": "function", "function": {"name": "nope"}})
    s, model = open_session(tok, endpoint, max_new_tokens=200, max_context=1024)
    assert len(ask(endpoint, s, "two").choices[0].message.tool_calls) == 2
    s, model = open_session(tok, endpoint, max_new_tokens=200, max_context=1024)
    out = ask(endpoint, s, "two", parallel_tool_calls=False)
    assert len(out.choices[0].message.tool_calls) == 1 and model.params[-1].stop == (
        "</tool_call>",
    )


def test_strict_tools_hold_calls_to_their_schema(tok: Any, endpoint: Any) -> None:
    strict = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": "Multiply.",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}},
                    "required": ["x"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    s, _ = open_session(tok, endpoint)
    messages = [{"role": "user", "content": "6*7"}]
    c = client(endpoint, s)
    out = c.chat.completions.create(model="policy", messages=messages, tools=strict)
    # the model's call {"x": "6*7"} (a string, not an integer): content, an invalid action
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert not done(s).turns[0].action_is_valid
    loose = [{**strict[0], "function": {**strict[0]["function"], "strict": False}}]
    s, _ = open_session(tok, endpoint)
    out = client(endpoint, s).chat.completions.create(
        model="policy", messages=messages, tools=loose
    )
    assert out.choices[0].message.tool_calls[0].function.name == "calc"


def test_logprobs_and_top_logprobs(tok: Any, endpoint: Any) -> None:
    s, model = open_session(tok, endpoint)
    out = ask(endpoint, s, "chat", logprobs=True, top_logprobs=2, max_tokens=3)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == [-0.01, -0.02, -0.03]
    assert [c.token for c in content] == ["T", "h", "e"]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        [0.0, -0.1],
        [-0.1, -0.2],
        [-0.2, -0.3],
    ]
    assert model.params[-1].top_logprobs == 2
    s, model = open_session(tok, endpoint)
    out = ask(endpoint, s, "chat", logprobs=False)
    assert out.choices[0].logprobs is None and model.params[-1].top_logprobs == 0


def test_sampling_fields_are_the_recipes_or_refused(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint)
    ask(endpoint, s, "chat", temperature=1.0, top_p=1.0, presence_penalty=0, logit_bias={})
    for field, value in [
        ("temperature", 0.0),
        ("top_p", 0.9),
        ("seed", 3),
        ("logit_bias", {"5": 2}),
    ]:
        s, _ = open_session(tok, endpoint)
        with pytest.raises(openai.BadRequestError, match=rf"{field}=.*rollout.agent_sampling"):
            ask(endpoint, s, "chat", **{field: value})
        assert done(s).turns == []
    s, model = open_session(tok, endpoint, agent_sampling="recipe")
    out = ask(endpoint, s, "chat", temperature=0.0, seed=3)
    assert out.model_extra["roll"]["sampling_overridden"] == ["temperature", "seed"]
    assert model.params[-1].temperature == 1.0


def test_refused_rows_get_their_400_and_accepted_rows_change_nothing(
    tok: Any, endpoint: Any
) -> None:
    asks = {
        "n": 2,
        "response_format": {"type": "json_object"},
        "store": True,
        "service_tier": "flex",
        "modalities": ["text", "audio"],
        "reasoning_effort": "low",
        "verbosity": "low",
        "audio": {"voice": "alloy", "format": "wav"},
        "prediction": {"type": "content", "content": "x"},
        "web_search_options": {},
        "functions": [{"name": "f"}],
        "function_call": "auto",
        "moderation": {},
        "prompt_cache_options": {},
        "prompt_cache_retention": "24h",
    }
    refused = [n for n, _, _ in table_rows(FIELDS) if FIELDS[n].status == "refused"]
    assert sorted(asks) == sorted(refused)
    for name, value in asks.items():
        s, _ = open_session(tok, endpoint)
        with pytest.raises(openai.BadRequestError) as err:
            ask(endpoint, s, "chat", extra_body={name: value})
        assert err.value.body["param"] == name and done(s).turns == []
    s, _ = open_session(tok, endpoint)
    inert = {"n": 1, "response_format": {"type": "text"}, "store": False, "service_tier": "auto"}
    extra = {
        "user": "u1",
        "metadata": {"a": "b"},
        "safety_identifier": "x",
        "prompt_cache_key": "k",
    }
    out = ask(endpoint, s, "chat", extra_body={**inert, **extra})
    assert out.choices[0].message.content == "The answer is 42. END of story"
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: foo"):
        ask(endpoint, open_session(tok, endpoint)[0], extra_body={"foo": 1})


def test_model_names_and_context_errors_clients_understand(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint)
    c = client(endpoint, s)
    for name in ("builtin:tiny-qwen3", "policy", "gpt-4o"):
        c.chat.completions.create(model=name, messages=[{"role": "user", "content": "chat"}])
        with s.lock:
            s.messages, s.traj = [], Trajectory("calc", 0, 0, 0)
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "chat"}])
    assert err.value.code == "model_not_found"
    assert c.models.retrieve("gpt-4o").id == "gpt-4o"
    s, _ = open_session(tok, endpoint, max_context=100)
    with pytest.raises(openai.BadRequestError) as err:
        ask(endpoint, s, "y" * 200)
    assert err.value.code == "context_length_exceeded"
    assert "This model's maximum context length is 100 tokens" in err.value.message
    litellm = pytest.importorskip("litellm")
    s, _ = open_session(tok, endpoint, max_context=100)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model="openai/policy",
            api_base=endpoint.base_url(s),
            api_key="roll",
            messages=[{"role": "user", "content": "y" * 200}],
        )


# ---- bad input over raw HTTP ------------------------------------------------------------------
def raw(
    endpoint: AgentEndpoint, method: str, path: str, body: bytes | None, **headers: str
) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        res = conn.getresponse()
        return res.status, res.getheader("Content-Type") or "", res.read()
    finally:
        conn.close()


def test_bad_input_never_gets_a_5xx_or_html_and_holds_no_thread(tok: Any, endpoint: Any) -> None:
    s, _ = open_session(tok, endpoint)
    url = (
        endpoint.base_url(s).removeprefix(f"http://127.0.0.1:{endpoint.port}") + "/chat/completions"
    )

    def body(**kw: Any) -> bytes:
        return json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "chat"}], **kw}
        ).encode()

    msg = [{"role": "user", "content": "chat"}]
    cases: list[tuple[str, str, bytes | None, dict[str, str], int]] = [
        ("POST", url, b"[1, 2]", {}, 400),
        ("POST", url, b'"hello"', {}, 400),
        ("POST", url, b"{not json", {}, 400),
        ("POST", url, b'{"model": "policy", "messages": "\xff\xfe"}', {}, 400),
        ("POST", url, body(n="two"), {}, 400),
        ("POST", url, body(max_tokens="10"), {}, 400),
        ("POST", url, body(max_tokens=-1), {}, 400),
        ("POST", url, body(logprobs="yes"), {}, 400),
        ("POST", url, body(logprobs=True, top_logprobs=30), {}, 400),
        ("POST", url, body(top_logprobs=2), {}, 400),
        ("POST", url, body(stream_options={"include_usage": True}), {}, 400),
        ("POST", url, body(stop=["a", "b", "c", "d", "e"]), {}, 400),
        ("POST", url, body(stop=[1]), {}, 400),
        ("POST", url, body(temperature="hot"), {}, 400),
        ("POST", url, body(logit_bias=[1]), {}, 400),
        ("POST", url, body(tools="calc"), {}, 400),
        ("POST", url, body(tool_choice="sometimes"), {}, 400),
        ("POST", url, body(tool_choice={"type": "function"}), {}, 400),
        ("POST", url, json.dumps({"model": "policy", "messages": []}).encode(), {}, 400),
        ("POST", url, json.dumps({"messages": msg}).encode(), {}, 400),
        ("POST", url, json.dumps({"model": 3, "messages": msg}).encode(), {}, 400),
        (
            "POST",
            url,
            json.dumps({"model": "policy", "messages": [{"content": "x"}]}).encode(),
            {},
            400,
        ),
        (
            "POST",
            url,
            json.dumps({"model": "policy", "messages": [{"role": "user", "content": 5}]}).encode(),
            {},
            400,
        ),
        (
            "POST",
            url,
            json.dumps(
                {
                    "model": "policy",
                    "messages": [{"role": "user", "content": [{"type": "image_url"}]}],
                }
            ).encode(),
            {},
            400,
        ),
        (
            "POST",
            url,
            json.dumps(
                {
                    "model": "policy",
                    "messages": [
                        *msg,
                        {"role": "assistant", "tool_calls": "calc"},
                        {"role": "user", "content": "x"},
                    ],
                }
            ).encode(),
            {},
            400,
        ),
        (
            "POST",
            url,
            json.dumps(
                {
                    "model": "policy",
                    "messages": [
                        *msg,
                        {
                            "role": "assistant",
                            "tool_calls": [
                                {
                                    "id": "c",
                                    "type": "function",
                                    "function": {"name": "calc", "arguments": [1]},
                                }
                            ],
                        },
                        {"role": "tool", "content": "x"},
                    ],
                }
            ).encode(),
            {},
            400,
        ),
        (
            "POST",
            url,
            json.dumps(
                {"model": "policy", "messages": [{"role": "user", "content": "x", "surprise": 1}]}
            ).encode(),
            {},
            400,
        ),
        ("POST", url, body(), {"Content-Length": str(64 * 2**20)}, 413),
        ("DELETE", "/nothing/here", None, {}, 404),
        ("PUT", url, body(), {}, 405),
        ("GET", url, None, {}, 405),
        ("HEAD", url, None, {}, 405),
        ("POST", url.replace("chat/completions", "completions"), body(), {}, 404),
        ("POST", "/s/nosuchsession/v1/chat/completions", body(), {}, 404),
        ("POST", "/v1/chat/completions", body(), {}, 404),
    ]
    before = threading.active_count()
    for method, path, data, headers, want in cases:
        status, kind, text = raw(endpoint, method, path, data, **headers)
        assert status == want, (method, path, data, status, text)
        if method != "HEAD":
            assert kind == "application/json" and "error" in json.loads(text), text
    assert done(s).turns == []
    # no Content-Length; a body shorter than its Content-Length: 411, then 408 after the timeout
    sock = socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
    sock.sendall(f'POST {url} HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{{"model"'.encode())
    start = time.monotonic()
    answer = sock.recv(4096).decode()
    assert answer.startswith("HTTP/1.0 408") or answer.startswith("HTTP/1.1 408"), answer
    assert time.monotonic() - start < 5 and "application/json" in answer
    sock.close()
    sock = socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
    sock.sendall(f"POST {url} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert sock.recv(4096).decode().startswith("HTTP/1.1 411")
    sock.close()
    # an idle connection that never sends a request is closed after the read timeout
    idle = socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
    assert idle.recv(10) == b""
    idle.close()
    time.sleep(0.2)
    assert threading.active_count() <= before  # no handler thread left waiting
