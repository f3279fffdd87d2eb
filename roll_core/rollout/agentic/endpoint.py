"""The OpenAI-compatible endpoint roll serves during agentic rollout (bring your own agent).

An agent program (:mod:`roll_core.envs.agents`) talks to the policy being trained through the
official ``openai`` client. Each episode gets its own session, a base URL
``http://127.0.0.1:PORT/s/<token>/v1``; its calls are stitched into one trajectory, exactly as
the env path builds one (token-in/token-out, :mod:`.chat`):

* the first ``POST /chat/completions`` renders its ``messages`` (and ``tools``, OpenAI function
  format, through the chat template's ``tools=``) into the first prompt;
* a later call that continues the conversation (the earlier messages, the assistant message
  this endpoint returned, then either tool results (``tool`` messages) or one user message):
  its prompt is the trace so far (prompt ids + generated ids) plus the template's ids for the
  new messages only; nothing is re-rendered, so what is trained is exactly what the model was
  given plus what it generated;
* a later call that does not continue it (it rewrites or drops earlier messages, e.g. an agent
  that sends only the system prompt and the current state each call, changes the tools, or
  starts another conversation): with ``history="segment"`` (``rollout.agent_history``, the
  default) it starts a new *segment* of the episode: the current trace is closed
  (``Trajectory.segments``) and the call is rendered as a first call. Each segment is trained
  as its own sequence (its prompt + generated ids, token-in/token-out within it) with the
  episode's return. With ``history="strict"`` it is refused (HTTP 400, the message says what
  differs). Every turn's ``state_key`` is its prompt ids (hashed): step-level credit (GiGPO)
  treats calls of a group that saw the same prompt as the same state;
* the response carries the model's native tool calls (``message.tool_calls``, read by the
  ``hermes`` parser of :mod:`roll_core.envs.tool_parsers`) and, with ``logprobs: true``, the
  behaviour log-prob of every generated token. A call that names a tool the request did not
  declare, or that cannot be read, is not returned as a tool call: the text comes back as
  ``content`` (finish_reason ``stop``) and the turn counts as an invalid action;
* a call changes the trajectory only once it is served: its prompt is computed aside, and the
  trajectory gets it (a new segment if it starts one, the prompt's new ids, the generated ids,
  the turn) after the reply was delivered. A refused call (HTTP 400: the conversation does not
  fit ``max_context``, a rewrite under ``strict``, a bad tool schema, ...; 503: generation
  stopped) leaves the trajectory exactly as it was, so neither it nor an agent's retries of it
  add a training row. A context refusal still ends the episode with status ``context``;
* a client that hangs up before its reply (its own timeout, a cancelled task, a dead agent):
  before writing, the handler looks at the connection (an HTTP client sends nothing while it
  waits for a reply, so a socket at end of stream or reset is one that hung up), and a broken
  pipe while writing means the same; the reply is then not recorded (the agent never saw it,
  so its tokens are not trained; counted as ``rollout/<tag>/agent_replies_undelivered``), and
  the session stays as it was before the call, so a retry is served like a first try. The
  session's lock is held from the prompt to the record, so the agent's next call, and
  ``close_session`` (before the episode reads its trajectory), wait until the reply is
  recorded. A client that hangs up after the reply reached the kernel's socket
  buffer cannot be told from one that read it (TCP does not say); such a turn is kept. A
  connection the client closed prints no traceback.

Sampling is the recipe's (``rollout.temperature`` etc.): ``temperature``, ``top_p`` and
``max_tokens`` in a request are ignored, so the samples stay on-policy. ``GET /v1/models`` lists
the one model. The server is the standard library's threading HTTP server: each request blocks
its own thread on the router's future, which is what the router's thread-and-future API wants;
no web framework is needed for two routes on the loopback interface.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import secrets
import socket
import sys
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from roll_core.backends.infer import Completion
from roll_core.envs.base import ToolResult
from roll_core.envs.tool_parsers import ToolCall, parse_hermes
from roll_core.errors import ConfigError, RollError
from roll_core.rollout.agentic.chat import ChatFormat
from roll_core.rollout.agentic.episode import Trajectory, Turn


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


Generate = Callable[[list[int], int, Any], Completion]
Deliver = Callable[[dict[str, Any]], None]


class ClientGone(Exception):
    """The client hung up before it got the reply (it timed out, was cancelled, or died)."""


@dataclass(frozen=True)
class _Call:
    """What one call would add to the session, computed without changing it: the prompt the
    model is given, the ids the trace gets before the generated ones, and the conversation as
    the session knows it afterwards. Applied only once the reply reached the client."""

    prompt: list[int]
    context: list[int]
    new_segment: bool
    keys: list[tuple[Any, ...]]
    tools_key: str | None
    tool_names: frozenset[str]


@dataclass
class AgentSession:
    """One episode's conversation: the trajectory its calls are stitched into."""

    traj: Trajectory
    chat: ChatFormat
    generate: Generate
    max_new_tokens: int
    max_context: int
    model: str
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    lock: threading.Lock = field(default_factory=threading.Lock)
    messages: list[tuple[Any, ...]] = field(default_factory=list)  # keys of what was sent
    tools_key: str | None = None
    tool_names: frozenset[str] = frozenset()
    after_eos: bool = False
    last_call: float = 0.0
    failure: BaseException | None = None  # a generation failure / cancel: the episode's end
    context_full: bool = False  # a call was refused for the context: the episode's end
    context_error: str = ""  # why (the refusal's text)
    closed: bool = False
    request: list[Any] = field(default_factory=list)  # the messages of the call being served
    history: str = "segment"  # a call that does not continue: new segment | strict: HTTP 400
    undelivered: int = 0  # replies the client hung up before receiving (not recorded)

    # ---- one call ------------------------------------------------------------------------------
    def complete(self, body: dict[str, Any], deliver: Deliver | None = None) -> dict[str, Any]:
        """Serve one call: the reply, recorded in the trajectory once ``deliver(reply)``
        returned (``deliver`` raises ClientGone: nothing is recorded). A refused call (any
        EndpointError) leaves the session and its trajectory exactly as they were."""
        with self.lock:
            if self.closed or self.failure is not None:
                raise EndpointError(410, "this episode has ended; its session is closed.", "gone")
            self.request = _messages(body)
            messages = [_normalise(m, k) for k, m in enumerate(self.request)]
            call = self._prompt(messages, _tools(body))
            if len(call.prompt) + self.max_new_tokens > self.max_context:
                self.context_full = True
                self.context_error = (
                    f"the conversation ({len(call.prompt)} tokens) plus max_new_tokens="
                    f"{self.max_new_tokens} does not fit rollout.max_context={self.max_context}"
                )
                raise EndpointError(
                    400,
                    f"{self.context_error}; the episode ends here (status `context`).",
                    "context_length_exceeded",
                )
            t0 = time.perf_counter()
            env_s = t0 - self.last_call if self.last_call else 0.0
            try:
                completion = self.generate(call.prompt, len(self.traj.turns), None)
            except BaseException as err:  # cancelled, timed out, rank lost: ends the episode
                self.failure = err
                raise EndpointError(
                    503, f"generation stopped: {type(err).__name__}: {err}"
                ) from err
            done = time.perf_counter()
            message, finish, valid = self._answer(completion, call.tool_names)
            response = self._response(completion, message, finish, body, call)
            if deliver is not None:
                try:
                    deliver(response)
                except ClientGone:
                    self.undelivered += 1  # never seen by the agent: not trained
                    raise
            self._record(call, completion, message, valid, done - t0, env_s)
            self.last_call = done
            return response

    def _prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> _Call:
        """The call's prompt and what it adds (see _Call); the session is not changed."""
        keys = [_key(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True) if tools else None
        if self.messages:
            problem = self._not_continued(messages, keys, tools_key)
            if problem is None:  # the conversation goes on: append the new messages' ids
                ids = self._continuation(messages[len(self.messages) :])
                prompt = [*self.traj.trace.ids, *ids]
                return _Call(prompt, ids, False, keys, self.tools_key, self.tool_names)
            if self.history == "strict":
                raise EndpointError(400, problem)
        # the first call of a segment (history "segment": a call that does not continue the
        # conversation starts a new sequence): the template renders the whole conversation
        names = frozenset(str(t["function"]["name"]) for t in tools or [])
        if tools and tools_key != self.tools_key:
            self._check_tools(tools, names)
        ids = self.chat.prompt([m["render"] for m in messages], tools)
        return _Call(ids, ids, bool(self.messages), keys, tools_key, names)

    def _not_continued(
        self, messages: list[dict[str, Any]], keys: list[tuple[Any, ...]], tools_key: str | None
    ) -> str | None:
        """Why this call does not continue the segment's conversation (None: it does)."""
        if tools_key != self.tools_key:
            return (
                "the tools differ from the first call of this episode; with "
                "rollout.agent_history: strict one episode is one conversation with one set "
                "of tools."
            )
        n = len(self.messages)
        if keys[:n] != self.messages:
            pairs = enumerate(zip(keys, self.messages, strict=False))
            k = next((i for i, (a, b) in pairs if a != b), len(keys))
            return _rewrite_message(k, keys, self.messages)
        roles = [m["role"] for m in messages[n:]]
        if not roles or roles[-1] not in ("tool", "user"):
            return (
                "a call must add tool results or a user message after the assistant's last "
                f"answer (got {roles or 'nothing new'})."
            )
        if not all(r == "tool" for r in roles) and len(roles) != 1:
            return (
                "after the assistant's last answer a call adds either tool results or one "
                f"user message, not {roles}."
            )
        return None

    def _continuation(self, new: list[dict[str, Any]]) -> list[int]:
        """The template's ids for the messages a continuing call adds (tool results, or one
        user message) after the assistant's last answer."""
        if all(m["role"] == "tool" for m in new):
            results = [
                ToolResult(m["render"].get("name", ""), m["content"], m.get("call_id")) for m in new
            ]
            return self.chat.tool_message(results, after_eos=self.after_eos)
        return self.chat.env_message(new[0]["content"], after_eos=self.after_eos)

    def _check_tools(self, tools: list[dict[str, Any]], names: frozenset[str]) -> None:
        from roll_core.data.chat import tool_support_problem

        problem = tool_support_problem(self.chat.tokenizer, tools)
        if problem:
            raise EndpointError(
                400,
                f"the request declares tools ({', '.join(sorted(names))}), but the "
                f"chat template has no tool support: {problem}, so the model would never see "
                "them. Set rollout.chat_template to a template that renders `tools` (e.g. "
                "Qwen2.5's or Qwen3's).",
            )
        name = next(iter(sorted(names)))
        self.chat.tool_reply_text([ToolResult(name, "ROLL_TOOL_PROBE")])  # a ModelError: 400

    def _answer(
        self, completion: Completion, tool_names: frozenset[str]
    ) -> tuple[dict[str, Any], str, bool]:
        """The assistant message of a completion, its finish_reason, and whether its tool calls
        (if any) were readable calls of the declared ``tool_names``."""
        tok = self.chat.tokenizer
        text = str(tok.decode(completion.response_ids, skip_special_tokens=True))
        parsed = parse_hermes(text)
        unknown = [c.name for c in parsed.calls if c.name not in tool_names]
        valid = not parsed.errors and not unknown
        if parsed.calls and valid:
            turn = len(self.traj.turns)
            calls = [_openai_call(c, f"call_{turn}_{k}") for k, c in enumerate(parsed.calls)]
            message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
            return message, "tool_calls", True
        content = text.strip() if parsed.has_calls else parsed.content or text.strip()
        finish = "length" if completion.finish_reason == "length" else "stop"
        return {"role": "assistant", "content": content}, finish, valid

    def _record(
        self,
        call: _Call,
        completion: Completion,
        message: dict[str, Any],
        valid: bool,
        gen_s: float,
        env_s: float,
    ) -> None:
        """Apply a served call to the session: its prompt's new ids, then the generated ids."""
        if call.new_segment:
            self.traj.new_segment()
        self.traj.trace.add_context(call.context)
        self.tools_key, self.tool_names = call.tools_key, call.tool_names
        self.messages = list(call.keys)
        prompt = call.prompt
        ids = list(completion.response_ids)
        self.traj.trace.add_generated(ids, list(completion.log_probs))
        self.after_eos = bool(ids) and ids[-1] == self.chat.eos_id
        self.messages.append(_key(_normalise(message, len(self.messages))))
        self.traj.turns.append(
            Turn(
                prompt_ids=prompt,
                response_ids=ids,
                log_probs=list(completion.log_probs),
                finish_reason=completion.finish_reason,
                policy_version=completion.policy_version,
                action=str(message.get("content") or ""),
                reward=0.0,
                state_key=prompt_key(prompt),
                segment=len(self.traj.segments),
                action_is_valid=valid,
                gen_s=gen_s,
                env_s=env_s,
            )
        )

    def _response(
        self,
        completion: Completion,
        message: dict[str, Any],
        finish: str,
        body: dict[str, Any],
        call: _Call,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": None,
        }
        if body.get("logprobs"):
            tok = self.chat.tokenizer
            content = []
            for tid, lp in zip(completion.response_ids, completion.log_probs, strict=True):
                piece = str(tok.decode([tid]))
                content.append(
                    {
                        "token": piece,
                        "logprob": float(lp),
                        "bytes": list(piece.encode()),
                        "top_logprobs": [],
                    }
                )
            choice["logprobs"] = {"content": content}
        n_prompt, n_gen = len(call.prompt), len(completion.response_ids)
        return {
            "id": f"chatcmpl-{self.token}-{len(self.traj.turns) + 1}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_gen,
                "total_tokens": n_prompt + n_gen,
            },
        }


def prompt_key(prompt: list[int]) -> str:
    """A turn's state for step-level credit (GiGPO's anchor): its prompt ids, hashed, so calls
    of one group that saw exactly the same prompt are the same state."""
    return hashlib.blake2b(array("q", prompt).tobytes(), digest_size=12).hexdigest()


# ---- messages ------------------------------------------------------------------------------------
def _messages(body: dict[str, Any]) -> list[Any]:
    if body.get("stream"):
        raise EndpointError(400, "stream=true is not supported by roll's rollout endpoint.")
    if int(body.get("n", 1) or 1) != 1:
        raise EndpointError(400, "n > 1 is not supported: make one call per sample.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "`messages` must be a non-empty list.")
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    from roll_core.envs.tools import schema_problems

    tools = body.get("tools") or None
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise EndpointError(400, "`tools` must be a list of {'type': 'function', ...} objects.")
    for k, tool in enumerate(tools):
        problems = schema_problems(tool)
        if problems:
            raise EndpointError(400, f"tools[{k}] is not a valid tool: {'; '.join(problems)}.")
    return tools


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise EndpointError(400, f"{where}: only text content parts are supported.")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise EndpointError(400, f"{where}: content must be a string or a list of text parts.")


def _normalise(msg: Any, k: int) -> dict[str, Any]:
    """A request message as ``{role, content, calls, render}`` (``render``: the message the
    chat template gets: tool-call arguments as objects, as templates expect)."""
    where = f"messages[{k}]"
    if not isinstance(msg, dict) or msg.get("role") not in (
        "system",
        "user",
        "assistant",
        "tool",
        "developer",
    ):
        raise EndpointError(
            400, f"{where} is not a chat message with a role (system, user, assistant or tool)."
        )
    role = "system" if msg["role"] == "developer" else str(msg["role"])
    content = _text(msg.get("content"), where)
    calls: list[ToolCall] = []
    for j, call in enumerate(msg.get("tool_calls") or []):
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise EndpointError(
                    400, f"{where}.tool_calls[{j}].function.arguments is not JSON."
                ) from None
        calls.append(ToolCall(str(fn.get("name", "")), dict(args), call.get("id")))
    render: dict[str, Any] = {"role": role, "content": content}
    if calls:
        render["tool_calls"] = [ToolCall(c.name, c.arguments).openai() for c in calls]
    if role == "tool":
        render["name"] = str(msg.get("name") or "")
    out = {"role": role, "content": content, "calls": calls, "render": render}
    if role == "tool" and msg.get("tool_call_id"):
        out["call_id"] = str(msg["tool_call_id"])
    return out


def _key(m: dict[str, Any]) -> tuple[Any, ...]:
    calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in m["calls"])
    return (m["role"], m["content"].strip(), calls)


def _openai_call(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


def _rewrite_message(k: int, keys: list[tuple[Any, ...]], before: list[tuple[Any, ...]]) -> str:
    if k >= len(keys):
        return (
            f"the call sends {len(keys)} messages, fewer than the {len(before)} this episode "
            "already has: an episode is one conversation, continued call by call."
        )
    return (
        f"messages[{k}] differs from what this episode's conversation has there "
        f"(sent {_cut(keys[k])}, expected {_cut(before[k])}). Send the conversation back as "
        "it was, with the assistant message the endpoint returned appended unchanged "
        "(messages.append(response.choices[0].message)); the trained tokens are exactly "
        "what the model saw, so history cannot be rewritten."
    )


def _cut(key: tuple[Any, ...]) -> str:
    text = repr(key)
    return text if len(text) < 120 else text[:117] + "..."


# ---- the server ---------------------------------------------------------------------------------
class AgentEndpoint:
    """The HTTP server (a daemon thread) and its open sessions."""

    def __init__(self, *, port: int = 0, model: str = "policy") -> None:
        self.model = model
        self.sessions: dict[str, AgentSession] = {}
        self.lock = threading.Lock()
        try:
            self.server = _Server(("127.0.0.1", port), _handler(self))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise port_in_use(port) from None
            raise
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(  # a short poll: close() returns at once
            target=self.server.serve_forever, args=(0.05,), name="agent-endpoint", daemon=True
        )
        self.thread.start()

    def base_url(self, session: AgentSession) -> str:
        return f"http://127.0.0.1:{self.port}/s/{session.token}/v1"

    def open(self, session: AgentSession) -> str:
        with self.lock:
            self.sessions[session.token] = session
        return self.base_url(session)

    def close_session(self, session: AgentSession) -> None:
        with session.lock:
            session.closed = True
        with self.lock:
            self.sessions.pop(session.token, None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "roll"}],
        }


def port_in_use(port: int) -> ConfigError:
    return ConfigError(
        f"rollout.endpoint_port={port}: the port is in use on 127.0.0.1, so the agents' "
        "OpenAI-compatible endpoint cannot be served there.",
        hint="Set rollout.endpoint_port: 0 (any free port; each agent gets its base URL), or "
        "stop what listens on that port (`ss -ltnp | grep :PORT`).",
    )


def check_port(port: int) -> None:
    """A ConfigError if ``port`` (not 0) cannot be bound on 127.0.0.1 (before a run exists)."""
    if port == 0:
        return
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise port_in_use(port) from None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (mid-request or before its reply) is not an error of the run:
        no traceback on the console. Anything else is printed, as the standard library does."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def _handler(endpoint: AgentEndpoint) -> type[BaseHTTPRequestHandler]:
    """The request handler class of `endpoint`'s server."""
    return type("Handler", (_Handler,), {"endpoint": endpoint})


class _Handler(BaseHTTPRequestHandler):
    """One HTTP connection to the endpoint (`_handler` binds the endpoint)."""

    endpoint: AgentEndpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass  # the metrics count calls; a log line per call would drown the console

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except ConnectionError as err:  # broken pipe, reset: the client is gone
            self.close_connection = True
            raise ClientGone() from err

    def _deliver(self, payload: dict[str, Any]) -> None:
        """The reply of a served call, unless the client has hung up (ClientGone)."""
        if self._hung_up():
            self.close_connection = True
            raise ClientGone()
        self._send(200, payload)

    def _hung_up(self) -> bool:
        """Whether the client closed or reset the connection while its call was served:
        an HTTP client sends nothing while it waits for a reply, so a readable socket at
        end of stream is one that hung up (a timeout, a cancelled task, a dead agent)."""
        try:
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False  # nothing to read: still waiting for the reply
        except OSError:
            return True  # reset

    def _error(self, err: EndpointError) -> None:
        self._send(
            err.status,
            {"error": {"message": str(err), "type": err.code, "code": err.code, "param": None}},
        )

    def _route(self) -> tuple[AgentSession | None, str]:
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) >= 3 and parts[0] == "s":
            with self.endpoint.lock:
                session = self.endpoint.sessions.get(parts[1])
            if session is None:
                raise EndpointError(
                    404,
                    f"no open episode session {parts[1]!r} (it ended, "
                    "or the base URL is not the one roll gave run()).",
                    "not_found",
                )
            return session, "/" + "/".join(parts[2:])
        return None, "/" + "/".join(parts)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        try:
            _, route = self._route()
            if route != "/v1/models":
                raise EndpointError(404, f"no route GET {self.path}", "not_found")
            self._send(200, self.endpoint.models())
        except EndpointError as err:
            self._error(err)
        except ClientGone:
            pass

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        with contextlib.suppress(ClientGone):  # nothing to answer, nothing recorded
            self._post()

    def _post(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            session, route = self._route()
            if route != "/v1/chat/completions":
                raise EndpointError(404, f"no route POST {self.path}", "not_found")
            if session is None:
                raise EndpointError(
                    404,
                    "call the base URL roll gave run() (it names the "
                    "episode's session: .../s/<token>/v1).",
                    "not_found",
                )
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError as err:
                raise EndpointError(400, f"the request body is not JSON: {err}") from None
            session.complete(body, deliver=self._deliver)
        except ClientGone:
            raise
        except EndpointError as err:
            self._error(err)
        except RollError as err:  # e.g. a chat template without tool support
            self._error(EndpointError(400, err.message + (f" {err.hint}" if err.hint else "")))
        except Exception as err:  # noqa: BLE001 - an answer, not a dead connection
            self._error(EndpointError(500, f"{type(err).__name__}: {err}", "server_error"))
