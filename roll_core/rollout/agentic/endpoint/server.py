"""The HTTP side of the endpoint: routes, bounded reads, errors every client can read.

Each episode's session has the base URL ``http://127.0.0.1:PORT/s/<token>``; under it
``/v1/chat/completions`` (OpenAI Chat Completions), ``/v1/responses`` (the Responses API) and
``/v1/messages`` (Anthropic Messages) serve the same session, and ``GET /v1/models`` lists the
served model. OpenAI clients take ``.../s/<token>/v1`` as their base URL, Anthropic clients
``.../s/<token>``.

Every answer is JSON (or an event stream): a malformed body, a wrong type, an unknown route or
method gets a 4xx in the API's error shape, never an HTML page; a 5xx is a bug in roll (or
generation that stopped: 503). Request bodies are bounded (:data:`MAX_BODY`, 413 beyond); a
client that sends less than its Content-Length, or nothing at all on an open connection, is
cut off after ``read_timeout_s`` (408), so no thread waits forever. A client that hangs up
before its reply (its own timeout, a cancelled task, a dead agent): before writing, the handler
looks at the connection (an HTTP client sends nothing while it waits for a reply, so a socket
at end of stream or reset is one that hung up), and a broken pipe while writing means the
same; the reply is then not recorded (see :mod:`.session`). A client that hangs up after the
reply reached the kernel's socket buffer cannot be told from one that read it (TCP does not
say); such a turn is kept. A connection the client closed prints no traceback.

The server is the standard library's threading HTTP server: each request blocks its own thread
on the router's future, which is what the router's thread-and-future API wants; no web
framework is needed for a handful of routes on the loopback interface.
"""

from __future__ import annotations

import contextlib
import errno
import json
import select
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from roll_core.errors import ConfigError, RollError
from roll_core.rollout.agentic.endpoint.anthropic import (
    AnthropicCountTokens,
    AnthropicMessages,
)
from roll_core.rollout.agentic.endpoint.calls import (
    Api,
    ClientGone,
    EndpointError,
    Reply,
    openai_error,
)
from roll_core.rollout.agentic.endpoint.fields import check_model
from roll_core.rollout.agentic.endpoint.openai_chat import ChatCompletions
from roll_core.rollout.agentic.endpoint.responses import Responses
from roll_core.rollout.agentic.endpoint.session import AgentSession

MAX_BODY = 32 * 2**20  # bytes of one request body


def _apis() -> dict[str, Api]:
    apis: list[Api] = [
        ChatCompletions(),
        Responses(),
        AnthropicMessages(),
        AnthropicCountTokens(),
    ]
    return {api.route: api for api in apis}


class AgentEndpoint:
    """The HTTP server (a daemon thread) and its open sessions. ``model``: the served name
    (``GET /v1/models``); ``aliases``: other names a request may use for it."""

    def __init__(
        self,
        *,
        port: int = 0,
        model: str = "policy",
        aliases: tuple[str, ...] = (),
        read_timeout_s: float = 30.0,
    ) -> None:
        self.model = model
        self.names = tuple(dict.fromkeys((model, "policy", *aliases)))
        self.sessions: dict[str, AgentSession] = {}
        self.lock = threading.Lock()
        self.apis = _apis()
        try:
            self.server = _Server(("127.0.0.1", port), _handler(self, read_timeout_s))
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
        """The session's OpenAI base URL (an Anthropic client takes it without ``/v1``)."""
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

    def model_object(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "roll"}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_object(self.model)]}


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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise port_in_use(port) from None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up or stalled (mid-request or before its reply) is not an error
        of the run: no traceback on the console. Anything else is printed, as the standard
        library does."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def _handler(endpoint: AgentEndpoint, read_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    """The request handler class of `endpoint`'s server."""
    return type("Handler", (_Handler,), {"endpoint": endpoint, "timeout": read_timeout_s})


class _Handler(BaseHTTPRequestHandler):
    """One HTTP connection to the endpoint (`_handler` binds the endpoint and the socket
    timeout that bounds every read)."""

    endpoint: AgentEndpoint
    protocol_version = "HTTP/1.1"
    _body_read = False
    error_content_type = "application/json"
    error_message_format = '{"error": {"message": "%(message)s", "type": "invalid_request_error", "param": null, "code": "%(code)d"}}'  # noqa: E501 - one JSON line

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass  # the metrics count calls; a log line per call would drown the console

    # ---- writing ----------------------------------------------------------------------------------
    def _send(self, status: int, content_type: str, data: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if content_type == "text/event-stream":
                self.send_header("Cache-Control", "no-cache")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (ConnectionError, TimeoutError) as err:  # broken pipe, reset: the client is gone
            self.close_connection = True
            raise ClientGone() from err

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        self._send(status, "application/json", json.dumps(payload).encode())

    def _deliver(self, content_type: str, data: bytes) -> None:
        """The reply of a served call, unless the client has hung up (ClientGone)."""
        if self._hung_up():
            self.close_connection = True
            raise ClientGone()
        self._send(200, content_type, data)

    def _hung_up(self) -> bool:
        """Whether the client closed or reset the connection while its call was served:
        an HTTP client sends nothing while it waits for a reply, so a readable socket at
        end of stream is one that hung up (a timeout, a cancelled task, a dead agent)."""
        try:  # (the socket has a timeout: a recv would wait for data, so select first)
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False  # nothing to read: still waiting for the reply
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True  # reset

    def _error(self, err: EndpointError, api: Api | None) -> None:
        body = api.error_body(err) if api is not None else openai_error(err)
        if not self._body_read:  # its unread body must not be taken for the next request
            self.close_connection = True
        self._json(err.status, body)

    # ---- reading ----------------------------------------------------------------------------------
    def _body(self) -> Any:
        """The request's JSON body (bounded; 4xx for anything else)."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raw = self._chunked()
        else:
            text = self.headers.get("Content-Length")
            if text is None:
                raise EndpointError(411, "a request body needs a Content-Length header.")
            try:
                length = int(text)
            except ValueError:
                raise EndpointError(400, f"Content-Length {text!r} is not a number.") from None
            if length < 0 or length > MAX_BODY:
                self.close_connection = True
                raise EndpointError(
                    413, f"the request body ({length} bytes) is larger than {MAX_BODY} bytes."
                )
            raw = self._read(length)
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise EndpointError(400, f"the request body is not UTF-8: {err}.") from None
        except json.JSONDecodeError as err:
            raise EndpointError(400, f"the request body is not JSON: {err}.") from None

    def _read(self, n: int) -> bytes:
        try:
            data = self.rfile.read(n)
        except TimeoutError:
            data = b""
        if len(data) < n:
            self.close_connection = True
            raise EndpointError(
                408,
                f"the request body ended after {len(data)} of its {n} bytes (Content-Length) "
                f"and nothing more came for {self.timeout:g}s.",
                "request_timeout",
            )
        return data

    def _chunked(self) -> bytes:
        out = bytearray()
        while True:
            line = self.rfile.readline(64)
            try:
                size = int(line.split(b";")[0].strip() or b"x", 16)
            except ValueError:
                self.close_connection = True
                raise EndpointError(400, "a malformed chunked request body.") from None
            if size == 0:
                self.rfile.readline(64)
                return bytes(out)
            if len(out) + size > MAX_BODY:
                self.close_connection = True
                raise EndpointError(413, f"the request body is larger than {MAX_BODY} bytes.")
            out += self._read(size)
            self.rfile.readline(64)

    # ---- routing ----------------------------------------------------------------------------------
    def _route(self) -> tuple[str | None, str]:
        """The session token in the path (None: none) and the route under it."""
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) >= 2 and parts[0] == "s":
            return parts[1], "/" + "/".join(parts[2:])
        return None, "/" + "/".join(parts)

    def _session(self, token: str | None) -> AgentSession | None:
        if token is None:
            return None
        with self.endpoint.lock:
            session = self.endpoint.sessions.get(token)
        if session is None:
            raise EndpointError(
                404,
                f"no open episode session {token!r} (it ended, or the base URL is not the one "
                "roll gave the agent).",
                "not_found",
            )
        return session

    def _answer(self, method: str) -> None:
        """Serve one request; every refusal is a JSON error (ClientGone: nothing to answer)."""
        api: Api | None = None
        self._body_read = method in ("GET", "HEAD", "OPTIONS", "DELETE")
        try:
            token, route = self._route()
            api = self.endpoint.apis.get(route)  # known first: errors in its shape
            session = self._session(token)
            if method == "GET" and route.startswith("/v1/models"):
                self._models(route)
                return
            if api is None:
                raise EndpointError(404, self._no_route(method, route), "not_found")
            if method != "POST":
                raise EndpointError(405, f"{route} takes POST, not {method}.", "method_not_allowed")
            raw = self._body()
            self._body_read = True
            if session is None:
                raise EndpointError(
                    404,
                    "call the base URL roll gave the agent (it names the episode's session: "
                    ".../s/<token>/v1).",
                    "not_found",
                )
            self._call(api, session, raw)
        except ClientGone:
            raise
        except EndpointError as err:
            self._error(err, api)
        except RollError as err:  # e.g. a chat template without tool support
            self._error(EndpointError(400, err.message + (f" {err.hint}" if err.hint else "")), api)
        except Exception as err:  # noqa: BLE001 - an answer, not a dead connection
            traceback.print_exc()
            message = f"This is a bug in roll's agent endpoint: {type(err).__name__}: {err}"
            self._error(EndpointError(500, message, "server_error"), api)

    def _call(self, api: Api, session: AgentSession, raw: Any) -> None:
        model = check_model(
            raw.get("model") if isinstance(raw, dict) else None, self.endpoint.names
        )
        call, render = api.parse(raw, session, model)
        if getattr(api, "counts_tokens", False):  # e.g. /v1/messages/count_tokens
            self._json(200, {"input_tokens": session.count_tokens(call)})
            return

        def deliver(reply: Reply) -> None:
            self._deliver(*render(reply))

        session.serve(call, deliver=deliver)

    def _models(self, route: str) -> None:
        if route in ("/v1/models", "/v1/models/"):
            self._json(200, self.endpoint.models())
            return
        name = route.removeprefix("/v1/models/")
        check_model(name, self.endpoint.names)
        self._json(200, self.endpoint.model_object(name))

    def _no_route(self, method: str, route: str) -> str:
        served = ", ".join(sorted(self.endpoint.apis))
        if route == "/v1/completions":
            return (
                "/v1/completions (raw text prompts) is not served: an episode is a "
                f"conversation trained token-in/token-out; use one of {served}."
            )
        return f"no route {method} {route}; this endpoint serves POST {served} and GET /v1/models."

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's names
        with contextlib.suppress(ClientGone):  # nothing to answer, nothing recorded
            self._answer("POST")

    def do_GET(self) -> None:  # noqa: N802
        with contextlib.suppress(ClientGone):
            self._answer("GET")

    def do_PUT(self) -> None:  # noqa: N802
        with contextlib.suppress(ClientGone):
            self._answer("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        with contextlib.suppress(ClientGone):
            self._answer("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        with contextlib.suppress(ClientGone):
            self._answer("PATCH")

    def do_OPTIONS(self) -> None:  # noqa: N802
        with contextlib.suppress(ClientGone):
            self._answer("OPTIONS")

    def do_HEAD(self) -> None:  # noqa: N802
        self.close_connection = True  # the JSON error body is not what HEAD expects
        with contextlib.suppress(ClientGone):
            self._answer("HEAD")
