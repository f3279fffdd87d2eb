"""`roll view`: the rollout records of one or two runs in a browser (docs/view.md).

One page (static/index.html, app.js, style.css: plain HTML and JavaScript, no build step, no
network) reads the runs as JSON. :func:`serve` answers it on localhost (the page polls, so
a running run's new steps appear); :func:`export` writes one self-contained HTML file with the
page and every recorded step inlined. Endpoints of the server:

* ``/api/runs``: each run's id, meta, metrics.jsonl records and recorded steps' summaries;
* ``/api/step?run=I&step=N``: run I's step N (summary and rows);
* ``/api/prompts?run=I``: run I's prompt keys -> ``[[step, row index], ...]`` (compare).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from roll_core.errors import RunDirError, UsageError
from roll_core.runs import Run
from roll_core.tracking.jsonl import read_metrics
from roll_core.tracking.rollouts import (
    DIRNAME,
    read_step,
    read_summary,
    recorded_steps,
    step_path,
)

_STATIC = {"/": "index.html", "/app.js": "app.js", "/style.css": "style.css"}
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def static_text(name: str) -> str:
    """A file of the page (shipped as package data)."""
    return (resources.files(__package__) / "static" / name).read_text(encoding="utf-8")


@dataclass
class ViewData:
    """What the page reads, from the run directories (re-read as they grow)."""

    runs: list[Run]
    _summaries: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def runs_json(self) -> dict[str, Any]:
        return {"runs": [self._run_json(i, run) for i, run in enumerate(self.runs)]}

    def _run_json(self, i: int, run: Run) -> dict[str, Any]:
        steps = []
        for step in recorded_steps(run.dir):
            try:  # a step file is replaced whole (atomically): its summary cached by mtime
                key = (i, step, step_path(run.dir / DIRNAME, step).stat().st_mtime_ns)
            except FileNotFoundError:  # deleted since listed (a resume truncated it)
                continue
            with self._lock:
                cached = self._summaries.get(key)
            if cached is None:
                cached = read_summary(run.dir, step)
                with self._lock:
                    self._summaries[key] = cached
            steps.append(cached)
        meta = run.meta()
        return {
            "id": run.id,
            "name": meta.get("name") or meta.get("pipeline") or "",
            "status": meta.get("status", ""),
            "pipeline": meta.get("pipeline", ""),
            "metrics": read_metrics(run.metrics_path),
            "steps": steps,
        }

    def step_json(self, run: int, step: int) -> dict[str, Any]:
        head, rows = read_step(self.runs[run].dir, step)
        return {**head, "rows": rows}

    def prompts_json(self, run: int) -> dict[str, list[list[int]]]:
        """Each prompt key of run `run` -> where it was recorded: ``[step, row index]``."""
        index: dict[str, list[list[int]]] = {}
        for step in recorded_steps(self.runs[run].dir):
            _, rows = read_step(self.runs[run].dir, step)
            for k, row in enumerate(rows):
                index.setdefault(str(row.get("prompt_key")), []).append([step, k])
        return index


def open_runs(run_ids: Sequence[str], runs_dir: str | Path) -> ViewData:
    """The runs to show (one, or two to compare), checked to have rollout records."""
    if not 1 <= len(run_ids) <= 2:
        raise UsageError(
            f"roll view shows one run, or two to compare; got {len(run_ids)}.",
            hint="Pass one RUN_ID, or two.",
        )
    runs = [Run.open(runs_dir, rid) for rid in run_ids]
    for run in runs:
        if not recorded_steps(run.dir) and run.meta().get("status") != "running":
            raise UsageError(
                f"run {run.id} has no rollout records ({run.dir / 'rollouts'} is missing or "
                "empty).",
                hint="Rollout records are written by the RL pipelines (rlvr, agentic, on-policy "
                "distillation) of this roll version with tracking.rollout_records.enabled: "
                "true (the default); runs of older versions or of SFT/DPO have none.",
            )
    return ViewData(runs)


def export(data: ViewData, out: Path) -> Path:
    """Write one self-contained HTML file: the page with its script, style and every
    recorded step inlined (it opens offline, from the file). Each step is its own JSON
    script element, parsed when the page shows it (a run of 10,000 rows opens fast)."""

    def script(blob: Any, **attrs: str) -> str:
        # no "<" inside the element (a "</script>" or "<!--" in a response would end it)
        text = json.dumps(blob, ensure_ascii=False).replace("<", "\\u003c")
        extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
        return f'<script type="application/json"{extra}>{text}</script>\n'

    steps = [
        script(data.step_json(i, s), data_run=str(i), data_step=str(s))
        for i, run in enumerate(data.runs)
        for s in recorded_steps(run.dir)
    ]
    html = static_text("index.html")
    html = html.replace(
        '<link rel="stylesheet" href="style.css">', f"<style>\n{static_text('style.css')}</style>"
    )
    html = html.replace(
        '<script src="app.js"></script>',
        script(data.runs_json(), id="roll-data")
        + "".join(steps)
        + f"<script>\n{static_text('app.js')}</script>",
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)
    return out


def make_server(data: ViewData, *, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """The page's HTTP server on `host:port` (0: a free port); call ``serve_forever()``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            try:
                if url.path in _STATIC:
                    name = _STATIC[url.path]
                    body = static_text(name).encode()
                    self._send(body, _TYPES[Path(name).suffix])
                    return
                answer = _api(data, url.path, query)
            except (RunDirError, OSError, ValueError, KeyError, IndexError) as err:
                self._send(str(err).encode(), "text/plain", HTTPStatus.NOT_FOUND)
                return
            if answer is None:
                self._send(b"not found", "text/plain", HTTPStatus.NOT_FOUND)
                return
            self._send(json.dumps(answer).encode(), "application/json")

        def _send(self, body: bytes, kind: str, status: HTTPStatus = HTTPStatus.OK) -> None:
            self.send_response(status)
            self.send_header("Content-Type", f"{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as err:  # in use, or a port this user may not open
        raise UsageError(
            f"roll view cannot listen on {host}:{port} ({err.strerror}).",
            hint="Choose another --port, or leave it out (0: any free port).",
        ) from None
    server.daemon_threads = True
    return server


def _api(data: ViewData, path: str, query: dict[str, str]) -> Any:
    if path == "/api/runs":
        return data.runs_json()
    if path == "/api/step":
        return data.step_json(int(query["run"]), int(query["step"]))
    if path == "/api/prompts":
        return data.prompts_json(int(query["run"]))
    return None


def serve(
    data: ViewData,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ready: Callable[[str], None] = print,
) -> None:
    """Serve the page until interrupted; `ready(url)` once it listens."""
    server = make_server(data, host=host, port=port)
    ready(f"http://{host}:{server.server_address[1]}/")
    try:
        server.serve_forever()
    finally:
        server.server_close()


def view(
    run_ids: Sequence[str],
    *,
    runs_dir: str | Path = "runs",
    export_to: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    ready: Callable[[str], None] = print,
) -> Path | None:
    """`roll view`: write `export_to` (one HTML file) and return it, or serve the page on
    `host:port` until interrupted (`ready(url)` once it listens) and return None."""
    data = open_runs(run_ids, runs_dir)
    if export_to is not None:
        return export(data, export_to)
    serve(data, host=host, port=port, ready=ready)
    return None
