"""`roll view`'s server and export on a hand-made run directory (no browser: the JSON API,
the static files, errors). The page itself is tested in a browser: test_view_browser.py."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from roll_core.errors import UsageError
from roll_core.tracking.rollouts import RolloutStore
from roll_core.tracking.viewer import ViewData, export, make_server, open_runs


def make_run(runs: Path, run_id: str, steps: int = 2, status: str = "finished") -> Path:
    run = runs / run_id
    run.mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"status": status, "pipeline": "rlvr"}))
    lines = [json.dumps({"step": s, "time": 0.0, "rollout/reward_mean": s / 4}) for s in (1, 2)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    store = RolloutStore(run, max_mb=1)
    for s in range(1, steps + 1):
        rows = [{"row": k, "prompt_key": f"p{k % 2}", "response": "</script><!--"} for k in (0, 1)]
        store.write(s, {"rows": 2}, rows)
    return run


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    make_run(tmp_path, "a")
    server = make_server(open_runs(["a"], tmp_path))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def test_the_api_answers_runs_steps_and_prompts(served: str) -> None:
    kind, body = get(f"{served}/api/runs")
    assert kind.startswith("application/json")
    [run] = json.loads(body)["runs"]
    assert run["id"] == "a" and run["status"] == "finished"
    assert [s["step"] for s in run["steps"]] == [1, 2]
    assert [m["rollout/reward_mean"] for m in run["metrics"]] == [0.25, 0.5]
    step = json.loads(get(f"{served}/api/step?run=0&step=2")[1])
    assert step["summary"] == {"rows": 2} and [r["row"] for r in step["rows"]] == [0, 1]
    prompts = json.loads(get(f"{served}/api/prompts?run=0")[1])
    assert prompts == {"p0": [[1, 0], [2, 0]], "p1": [[1, 1], [2, 1]]}
    assert "roll view" in get(f"{served}/")[1]
    assert get(f"{served}/app.js")[0].startswith("text/javascript")
    for bad in ("/api/step?run=0&step=9", "/api/nothing", "/api/step?run=5&step=1"):
        with pytest.raises(urllib.error.HTTPError) as err:
            get(served + bad)
        assert err.value.code == 404


def test_a_new_step_file_shows_on_the_next_request(served: str, tmp_path: Path) -> None:
    RolloutStore(tmp_path / "a", max_mb=1).write(3, {"rows": 0}, [])
    [run] = json.loads(get(f"{served}/api/runs")[1])["runs"]
    assert [s["step"] for s in run["steps"]] == [1, 2, 3]


def test_export_escapes_what_would_end_a_script_element(tmp_path: Path) -> None:
    make_run(tmp_path, "a")
    html = export(open_runs(["a"], tmp_path), tmp_path / "out/a.html").read_text()
    assert html.count("</script>") == html.count("<script")  # the responses' are escaped
    assert "\\u003c/script>\\u003c!--" in html and 'href="style.css"' not in html


def test_runs_without_records_and_too_many_runs_are_usage_errors(tmp_path: Path) -> None:
    make_run(tmp_path, "empty", steps=0)
    with pytest.raises(UsageError, match="run empty has no rollout records"):
        open_runs(["empty"], tmp_path)
    make_run(tmp_path, "starting", steps=0, status="running")  # its records are to come
    assert isinstance(open_runs(["starting"], tmp_path), ViewData)
    with pytest.raises(UsageError, match="one run, or two"):
        open_runs(["empty", "empty", "empty"], tmp_path)


def test_a_port_in_use_is_a_usage_error(tmp_path: Path) -> None:
    make_run(tmp_path, "a")
    data = open_runs(["a"], tmp_path)
    first = make_server(data)
    try:
        with pytest.raises(UsageError, match="cannot listen on 127.0.0.1"):
            make_server(data, port=first.server_address[1])
    finally:
        first.server_close()
