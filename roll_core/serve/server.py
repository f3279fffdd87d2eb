"""The HTTP side of `roll serve`: the Tinker API routes (``/api/v1/...``) on the standard
library's threading HTTP server (each request on its own thread; a ``retrieve_future`` long
poll blocks only its own).

Answers: JSON, except the results the client reads as protobuf (``forward_backward``,
``asample``: see wire.py). A request the client got wrong answers 400 (or 404 for an unknown
id or route) with ``{"error": ..., "category": "user"}``; the client does not retry those. A
route the client knows but roll does not serve answers 404 with the same shape and a message
naming the route, never a hang. A failed future answers Tinker's ``RequestFailedResponse``
from ``retrieve_future``. 5xx only for a bug in roll.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from roll_core.serve.service import NotFound, TinkerService
from roll_core.serve.trainer import UserError

MAX_BODY = 256 * 2**20
PROTO = "application/x-protobuf"

UNSUPPORTED = {
    "/api/v1/create_custom_loss": "custom losses run on the client (forward_backward_custom)",
    "/api/v1/copy_weights": "copying weights between accounts",
    "/api/v1/save_weights_external": "external weight uploads",
    "/api/v1/join_sampling_session": "joining sampling sessions",
    "/api/v1/retrieve_futures": "batched future polling",
    "/api/v1/auth/token": "authentication (any API key is accepted)",
}
"""Routes of the client that roll serve answers with a user error, and why."""


class _HTTPServer(ThreadingHTTPServer):
    """The standard threading server, whose request threads :meth:`close` ends and joins.

    No thread of roll serve may still be running when the interpreter exits: Python ends a
    daemon thread that wakes up during finalization with ``pthread_exit``, and a thread that
    is inside torch then (which released the GIL in a C++ scope) aborts the process (SIGABRT)
    instead of exiting with the code roll chose."""

    daemon_threads = False  # server_close() joins every request thread
    block_on_close = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.discard(request)

    def hang_up(self) -> None:
        """End the kept-alive connections: a thread waiting for the next request reads the end
        of its stream and returns; one answering a request still sends its answer."""
        with self._open_lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):  # the client hung up first
                conn.shutdown(socket.SHUT_RD)


class TinkerServer:
    """The HTTP server (its own thread) around a TinkerService."""

    def __init__(self, service: TinkerService, host: str, port: int) -> None:
        self.service = service
        self.server = _HTTPServer((host, port), _handler(service))
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._reaper.start()

    def _reap(self) -> None:
        while not self._stop.wait(min(10.0, self.service.cfg.session_timeout_s / 2)):
            self.service.reap()

    def close(self) -> None:
        """Stop taking requests, end the queued ones (the running training request and
        samples finish), answer the waiting clients and join every thread."""
        self._stop.set()
        self.server.shutdown()  # no new connections
        self.service.close()
        self.server.hang_up()
        self.server.server_close()  # joins the request threads
        self._thread.join()
        self._reaper.join()


def _routes(s: TinkerService) -> dict[tuple[str, str], Callable[..., Any]]:
    return {
        ("GET", "/api/v1/healthz"): lambda: {"status": "ok"},
        ("GET", "/api/v1/get_server_capabilities"): s.capabilities,
        ("POST", "/api/v1/client/config"): lambda b: {
            "use_pyqwest_transport": False,
            "pjwt_auth_enabled": False,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False,
            "sample_join_sampling_session": False,
        },
        ("POST", "/api/v1/client/dynamic_config"): lambda b: {"sample_cancel_enabled": True},
        ("POST", "/api/v1/telemetry"): lambda b: {"status": "accepted"},
        ("POST", "/api/v1/create_session"): s.create_session,
        ("POST", "/api/v1/session_heartbeat"): s.heartbeat,
        ("POST", "/api/v1/create_model"): s.create_model,
        ("POST", "/api/v1/get_info"): s.get_info,
        ("POST", "/api/v1/optim_step"): s.optim_step,
        ("POST", "/api/v1/unload_model"): s.unload_model,
        ("POST", "/api/v1/save_weights"): lambda b: s.save_weights(b, sampler=False),
        ("POST", "/api/v1/save_weights_for_sampler"): lambda b: s.save_weights(b, sampler=True),
        ("POST", "/api/v1/load_weights"): s.load_weights,
        ("POST", "/api/v1/create_sampling_session"): s.create_sampling_session,
        ("POST", "/api/v1/asample"): s.asample,
        ("POST", "/api/v1/cancel_future"): lambda b: {
            "cancelled": s.futures.cancel(str(b.get("request_id")))
        },
    }


_FINISH = re.compile(r"^/api/v1/sessions/([^/]+)/finish$")
_SAMPLER = re.compile(r"^/api/v1/samplers/([^/]+)$")
_CHECKPOINTS = re.compile(r"^/api/v1/training_runs/([^/]+)/checkpoints$")
_RUN = re.compile(r"^/api/v1/training_runs/([^/]+)$")


def _handler(service: TinkerService) -> type[BaseHTTPRequestHandler]:
    routes = _routes(service)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return  # quiet: the console belongs to the command

        def do_GET(self) -> None:  # noqa: N802
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        def _body(self) -> bytes:
            size = int(self.headers.get("Content-Length") or 0)
            if size > MAX_BODY:
                raise UserError(f"request body of {size} bytes is over {MAX_BODY}")
            raw = self.rfile.read(size) if size else b""
            if self.headers.get("Content-Encoding") == "zstd":
                raise UserError("zstd request bodies are not served (proto_compress_fwdbwd)")
            return raw

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                raw = self._body() if method == "POST" else b""
                status, answer = 200, self._answer(method, path, raw)
            except UserError as err:
                status, answer = 400, {"error": str(err), "category": "user"}
            except NotFound as err:
                status, answer = 404, {"error": str(err), "category": "user"}
            except Exception as err:  # a bug in roll
                traceback.print_exc(file=sys.stderr)
                status, answer = 500, {"error": f"internal error: {err}", "category": "server"}
            self._send(status, answer)

        def _answer(self, method: str, path: str, raw: bytes) -> Any:
            if (method, path) == ("POST", "/api/v1/forward_backward"):
                return service.forward_backward(raw)
            if (method, path) == ("POST", "/api/v1/retrieve_future"):
                return _retrieve(service, _json(raw))
            fn = routes.get((method, path))
            if fn is not None:
                return fn() if method == "GET" else fn(_json(raw))
            if method == "POST" and (m := _FINISH.match(path)):
                service.close_session(m.group(1))
                return {}
            if method == "GET" and (m := _SAMPLER.match(path)):
                return service.get_sampler(m.group(1))
            if method == "GET" and (m := _CHECKPOINTS.match(path)):
                return service.list_checkpoints(m.group(1))
            if method == "GET" and (m := _RUN.match(path)):
                return service.training_run(m.group(1))
            if path in UNSUPPORTED:
                raise NotFound(f"{path} is not served by roll serve ({UNSUPPORTED[path]})")
            raise NotFound(f"{method} {path} is not a route of roll serve (see docs/serve.md)")

        def _send(self, status: int, answer: Any) -> None:
            if isinstance(answer, bytes):
                data, ctype = answer, PROTO
            else:
                data, ctype = json.dumps(answer).encode(), "application/json"
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    return Handler


def _retrieve(service: TinkerService, body: dict[str, Any]) -> Any:
    """A future's result, or ``try_again`` while it is still running."""
    rid = str(body.get("request_id"))
    try:
        result = service.futures.retrieve(rid)
    except KeyError:
        raise NotFound(f"unknown request_id {rid!r}") from None
    if result is None:
        return {"type": "try_again", "request_id": rid, "queue_state": "active"}
    return result


def _json(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"request body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise UserError("request body must be a JSON object")
    return body
