"""Page load of `roll view` on a run of 10,000 recorded rows, in headless Chromium.

Writes a synthetic run (meta.json, metrics.jsonl, rollouts/: `--steps` steps of `--rows` rows,
each row shaped like a real record: `--tokens` tokens of which the last 60% generated, every
per-token field filled), then opens the page in headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium) twice: served by `roll view`'s server, and as the file
`roll view --export` writes. Prints the seconds from navigation to the page's first step
rendered (its groups and cards in the DOM), the median of `--repeats` loads, and the sizes.

    python benchmarks/view_load.py [--steps 1250] [--rows 8] [--tokens 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from roll_core.tracking.rollouts import DIRNAME, encode_step, step_path
from roll_core.tracking.viewer import export, make_server, open_runs


def synth_row(rng: random.Random, k: int, group: int, tokens: int) -> dict[str, Any]:
    start = int(tokens * 0.4)
    n = tokens - start
    lp = [round(-rng.random() * 3, 5) for _ in range(n)]
    return {
        "row": k,
        "group": group,
        "reward": float(rng.random() < 0.5),
        "policy_version": 0,
        "staleness": 0,
        "length": n,
        "finish_reason": rng.choice(["stop", "length"]),
        "env": "math",
        "reward_parts": {"correct": True, "extracted": "12"},
        "prompt_key": f"p{group}",
        "start": start,
        "ids": [rng.randrange(256) for _ in range(tokens)],
        "tokens": [chr(97 + rng.randrange(26)) for _ in range(tokens)],
        "generated": [1] * n,
        "behaviour_lp": lp,
        "trainer_lp": [round(x + rng.gauss(0, 1e-3), 5) for x in lp],
        "ref_lp": lp,
        "teacher_lp": None,
        "advantage": [round(rng.gauss(0, 1), 5)] * n,
        "mask": [1.0] * n,
        "is_weight": None,
        "entropy": None,
        "prompt": "What is 12 + 34?",
        "response": "".join(chr(97 + k % 26) for _ in range(n)),
    }


def synth_run(runs_dir: Path, run_id: str, *, steps: int, rows: int, tokens: int) -> Path:
    """A finished run directory with `steps` x `rows` recorded rows."""
    run = runs_dir / run_id
    run.mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"status": "finished", "pipeline": "rlvr"}))
    metrics = [
        {"step": s, "time": 0, "rollout/reward_mean": s / steps} for s in range(1, steps + 1)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    rng = random.Random(0)
    summary = {"rows": rows, "groups": rows // 4, "reward_mean": 0.5, "max_staleness": 0}
    summary |= {"finish_reasons": {"stop": rows}, "envs": ["math"]}
    (run / DIRNAME).mkdir()
    for s in range(1, steps + 1):  # the files RolloutStore writes, without its fsync per file
        recs = [synth_row(rng, k, k // 4, tokens) for k in range(rows)]
        step_path(run / DIRNAME, s).write_text(encode_step(s, summary, recs))
    return run


def chromium() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def load_seconds(driver: Any, url: str, timeout: float = 60.0) -> float:
    """Navigation to the first step rendered (body[data-ready] and a card in the DOM)."""
    driver.get("about:blank")
    start = time.perf_counter()
    driver.get(url)
    while not driver.execute_script(
        "return document.body.dataset.ready === '1' && !!document.querySelector('.card')"
    ):
        if time.perf_counter() - start > timeout:
            raise TimeoutError(url)
        time.sleep(0.005)
    return time.perf_counter() - start


def measure(runs_dir: Path, run_id: str, repeats: int) -> dict[str, float]:
    data = open_runs([run_id], runs_dir)
    server = make_server(data)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    html = export(data, runs_dir / f"{run_id}.html")
    driver = chromium()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        served = statistics.median(load_seconds(driver, url) for _ in range(repeats))
        exported = statistics.median(load_seconds(driver, html.as_uri()) for _ in range(repeats))
    finally:
        driver.quit()
        server.shutdown()
    return {"served_s": served, "export_s": exported, "export_mb": html.stat().st_size / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1250)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        run = synth_run(Path(tmp), "big", steps=args.steps, rows=args.rows, tokens=args.tokens)
        size = sum(f.stat().st_size for f in (run / "rollouts").iterdir()) / 2**20
        print(
            f"run: {args.steps * args.rows} rows in {args.steps} steps, {size:.1f} MiB "
            f"(written in {time.perf_counter() - t:.1f} s)"
        )
        out = measure(Path(tmp), "big", args.repeats)
    print(f"page load, served (roll view):        {out['served_s']:.2f} s")
    print(f"page load, exported file ({out['export_mb']:.0f} MiB): {out['export_s']:.2f} s")


if __name__ == "__main__":
    main()
