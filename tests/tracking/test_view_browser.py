"""`roll view` in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`)
driven by Selenium opens the page of a finished tiny rlvr run (served by `roll view`) and of a
tiny agentic run with tool calls (`roll view --export`), and checks what a person sees against
the rollout records: a group's rewards, a token's overlay value on hover, the filters, an
episode's tool call and tool result, a running run's new step, two runs compared.

Skipped, with the reason, where Selenium or the browser is missing. With
``ROLL_VIEW_SCREENSHOTS=DIR`` the pages are saved as PNGs there; docs/img/ holds the ones
docs/view.md shows, made with the tiny SFT model (`nox -s demo` makes it) as the rlvr run's
model: ``ROLL_VIEW_MODEL=runs/tiny-arith-sft/final ROLL_VIEW_SCREENSHOTS=docs/img pytest
tests/tracking/test_view_browser.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROLL, make_cli_env, make_roll
from tests.tracking.tiny_runs import agent_recipe, rlvr_recipe

pytestmark = pytest.mark.slow


def _missing_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (it is in the dev extra: pip install -e '.[dev]')"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "no Chromium (Debian/Ubuntu: apt-get install chromium chromium-driver)"
    if not shutil.which("chromedriver"):
        return "no chromedriver (Debian/Ubuntu: apt-get install chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = _missing_browser()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, browser: Any) -> Path:
    """A finished 3-step rlvr run `rv` and a 1-step agentic run `ag` (tool calls)."""
    root = tmp_path_factory.mktemp("view")
    roll = make_roll(make_cli_env(tmp_path_factory.mktemp("cache")))
    # ROLL_VIEW_MODEL: the rlvr run's model (e.g. runs/tiny-arith-sft/final, for the docs'
    # screenshot: answers and rewards instead of a random model's bytes)
    model = {"path": os.environ.get("ROLL_VIEW_MODEL", "builtin:tiny-qwen3")}
    res = roll("train", "rlvr", str(rlvr_recipe(root, model=model)), "--run-id", "rv", timeout=300)
    assert res.returncode == 0, res.stderr
    res = roll("train", "agentic", str(agent_recipe(root)), "--run-id", "ag", timeout=600)
    assert res.returncode == 0, res.stderr
    return root / "runs"


def records(run_dir: Path, step: int) -> list[dict]:
    lines = (run_dir / f"rollouts/step-{step:06d}.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines[1:]]


def wait_ready(driver: Any, timeout: float = 10.0) -> float:
    """Seconds until the page says it has loaded (body[data-ready])."""
    start = time.perf_counter()
    while not driver.execute_script("return document.body.dataset.ready === '1'"):
        errors = driver.find_elements("css selector", "pre.error")
        assert not errors, errors[0].text
        assert time.perf_counter() - start < timeout, "the page did not load"
        time.sleep(0.02)
    return time.perf_counter() - start


def screenshot(driver: Any, name: str) -> None:
    out = os.environ.get("ROLL_VIEW_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(out) / name))


class Served:
    """`roll view RUN... --port 0` in a subprocess; `.url` once it listens."""

    def __init__(self, runs_dir: Path, *run_ids: str) -> None:
        env = make_cli_env(runs_dir.parent / "cache")
        self.proc = subprocess.Popen(
            [ROLL, "view", *run_ids, "--runs-dir", str(runs_dir), "--port", "0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, line + self.proc.stderr.read() if self.proc.stderr else line
        self.url = found.group(0)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def js_text(driver: Any, element_id: str) -> str:
    return str(driver.execute_script(f"return document.getElementById('{element_id}').textContent"))


def hover_value(driver: Any, row: dict, overlay: str, j: int) -> tuple[str, str]:
    """Choose `overlay`, hover generated token j of the open row: (its title, the hover line)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", "overlay")).select_by_value(overlay)
    token = driver.find_element("css selector", f"#tokens span[data-i='{row['start'] + j}']")
    ActionChains(driver).move_to_element(token).perform()
    return str(token.get_attribute("title")), driver.find_element("id", "hover").text


def test_rlvr_run_groups_rewards_token_overlays_and_filters(browser: Any, runs: Path) -> None:
    served = Served(runs, "rv")
    try:
        browser.get(served.url)
        wait_ready(browser)
        rows = records(runs / "rv", 3)  # the newest step is shown first
        assert "rv · step 3 · 8 recorded rows" in browser.find_element("id", "step-title").text
        for group in sorted({r["group"] for r in rows}):
            column = browser.find_element("css selector", f".group[data-group='{group}']")
            text = column.find_element("css selector", ".rewards").text
            shown = [float(x) for x in text.removeprefix("rewards: ").split(", ")]
            assert shown == [r["reward"] for r in rows if r["group"] == group]
        browser.find_element("id", "card-1").click()
        row = rows[1]
        names = {"behaviour_lp": "sampler log-prob", "advantage": "advantage", "entropy": "entropy"}
        assert row["entropy"] is not None and len(row["entropy"]) == len(row["behaviour_lp"])
        for overlay, name in names.items():
            key = overlay
            for j in (0, len(row[key]) - 1):
                title, line = hover_value(browser, row, overlay, j)
                assert float(title.removeprefix(f"{name}: ")) == row[key][j]
                assert f"token {row['start'] + j} " in line
                assert float(re.search(rf"{name}: (\S+)", line).group(1)) == row[key][j]
        title, _ = hover_value(browser, row, "gap", 0)
        gap = row["trainer_lp"][0] - row["behaviour_lp"][0]
        assert abs(float(title.removeprefix("log-prob gap: ")) - gap) < 1e-5
        hover_value(browser, row, "behaviour_lp", 1)  # the docs' picture: a coloured overlay
        screenshot(browser, "view-rlvr.png")
        # filters: finish reason, then reward
        from selenium.webdriver.support.ui import Select

        finish = rows[0]["finish_reason"]
        Select(browser.find_element("id", "f-finish")).select_by_value(finish)
        n = sum(r["finish_reason"] == finish for r in rows)
        assert browser.find_element("id", "filter-count").text == f"{n} of 8 rows shown"
        assert len(browser.find_elements("css selector", ".card")) == n
        Select(browser.find_element("id", "f-finish")).select_by_value("")
        browser.find_element("id", "f-reward-min").send_keys("0.5")
        n = sum(r["reward"] >= 0.5 for r in rows)
        assert browser.find_element("id", "filter-count").text == f"{n} of 8 rows shown"
    finally:
        served.close()


def test_agentic_episode_tool_calls_in_the_exported_page(browser: Any, runs: Path) -> None:
    out = runs.parent / "ag.html"
    roll = make_roll(make_cli_env(runs.parent / "cache"))
    res = roll("view", "ag", "--runs-dir", str(runs), "--export", str(out))
    assert res.returncode == 0, res.stderr
    browser.get(out.as_uri())
    wait_ready(browser)
    rows = records(runs / "ag", 1)
    # an episode where the policy called the tool and got its result back
    with_result = [
        i
        for i, r in enumerate(rows)
        if "<|im_start|>tool" in "".join(s["text"] for s in r["conversation"])
    ]
    assert with_result, "no recorded episode called the tool: the warm start did not take"
    k = with_result[0]
    browser.find_element("id", f"card-{k}").click()
    episode = js_text(browser, "episode")
    calls = [s["text"] for s in rows[k]["conversation"] if s["role"] == "model"]
    assert "<tool_call>" in calls[0] and '"name": "calc"' in calls[0]
    for span in rows[k]["conversation"]:
        assert span["text"] in episode
    assert f"episode: calculator_agent seed {rows[k]['episode']['seed']}" in episode
    browser.execute_script("document.getElementById('episode').scrollIntoView()")
    screenshot(browser, "view-agentic.png")


def test_a_running_run_shows_its_new_steps_and_two_runs_compare(browser: Any, runs: Path) -> None:
    live = runs / "live"
    shutil.copytree(runs / "rv", live)
    (live / "rollouts/step-000003.jsonl").unlink()
    meta = json.loads((live / "meta.json").read_text())
    (live / "meta.json").write_text(json.dumps({**meta, "status": "running"}))
    served = Served(runs, "live", "rv")
    try:
        browser.get(served.url)
        wait_ready(browser)
        assert "live · step 2" in browser.find_element("id", "step-title").text
        shutil.copy(runs / "rv/rollouts/step-000003.jsonl", live / "rollouts")
        deadline = time.time() + 10
        while "live · step 3" not in browser.find_element("id", "step-title").text:
            assert time.time() < deadline, "the new step did not appear"
            time.sleep(0.2)
        # the same prompts in the other run: the copy's rows are the original's
        browser.find_element("id", "card-0").click()
        deadline = time.time() + 10
        while "same prompt in rv" not in js_text(browser, "compare"):
            assert time.time() < deadline, "no comparison shown"
            time.sleep(0.2)
        row = records(runs / "rv", 3)[0]
        compare = js_text(browser, "compare")
        hits = sum(
            r["prompt_key"] == row["prompt_key"] for s in (1, 2, 3) for r in records(runs / "rv", s)
        )
        assert f"same prompt in rv: {hits} rows" in compare and row["response"] in compare
    finally:
        served.close()


def test_a_run_of_10000_recorded_rows_loads_in_under_2_s(browser: Any, tmp_path: Path) -> None:
    """The issue's bar, measured: served and exported (benchmarks/view_load.py prints it)."""
    import importlib.util
    import threading

    from roll_core.tracking.viewer import export, make_server, open_runs

    path = Path(__file__).resolve().parents[2] / "benchmarks/view_load.py"
    spec = importlib.util.spec_from_file_location("view_load", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.synth_run(tmp_path, "big", steps=1250, rows=8, tokens=100)
    data = open_runs(["big"], tmp_path)
    server = make_server(data)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        served = min(bench.load_seconds(browser, url) for _ in range(2))
        html = export(data, tmp_path / "big.html")
        exported = min(bench.load_seconds(browser, html.as_uri()) for _ in range(2))
    finally:
        server.shutdown()
    print(f"10,000 rows: served page {served:.2f} s, exported file {exported:.2f} s")
    assert served < 2.0 and exported < 2.0
    assert browser.find_element("id", "step-title").text.startswith("big · step 1250 · 8 recorded")
