"""tinker-cookbook's own loops, unchanged, against the real `roll serve`:

- RL (``tinker_cookbook.rl.train.main``): tests/serve/cookbook/rl_tiny.py gives it a
  cookbook-style env the tiny model can learn; the mean reward rises.
- SFT (the supervised basic recipe ``tinker_cookbook.recipes.sl_basic``, which runs
  ``tinker_cookbook.supervised.train.main``): tests/serve/cookbook/sl_tiny.py swaps in the
  cookbook's bundled example conversations, as the recipe documents; the train NLL falls.

tinker-cookbook 0.6.1 needs ``tml-renderers>=0.4.1``, which not every package index has;
neither loop nor the Qwen3 renderer imports it. The tests run the scripts with
``ROLL_COOKBOOK_PYTHON`` (an interpreter that imports ``tinker_cookbook``: `nox -s tests`
builds one, see noxfile.py's ``install_cookbook``), or this interpreter; this interpreter's
site-packages come after the script's own, so roll, torch, transformers and tinker are found.
Skipped when neither imports the cookbook."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, make_cli_env
from tests.serve.test_serve_tinker import Server

pytest.importorskip("tinker", reason="the tinker client is not installed")
pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "serve" / "cookbook"


def _cookbook_python(cache: Path, module: str) -> tuple[str, dict[str, str]]:
    """The interpreter that runs a cookbook script, and its environment (the server's roll
    cache, so the built-in model is written once); skips when it cannot import `module`."""
    python = os.environ.get("ROLL_COOKBOOK_PYTHON") or sys.executable
    paths = [str(ROOT), *site.getsitepackages()]
    env = {**make_cli_env(cache), "PYTHONPATH": os.pathsep.join(paths)}
    env["TINKER_API_KEY"] = "tml-local"
    probe = subprocess.run([python, "-c", f"import {module}"], env=env, capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            "tinker-cookbook is not importable (set ROLL_COOKBOOK_PYTHON to an interpreter "
            "with tinker-cookbook 0.6.1; see this module's docstring)"
        )
    return python, env


def _run(script: str, module: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`roll serve` (recipes/serve/tiny.yaml) and the cookbook script against it."""
    python, env = _cookbook_python(tmp_path / "cache", module)
    srv = Server(tmp_path / "ckpt", tmp_path / "cache")
    try:
        res = subprocess.run(
            [python, str(SCRIPTS / script), srv.url, str(tmp_path / "log")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        srv.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_cookbook_rl_loop_raises_the_reward(tmp_path) -> None:
    res = _run("rl_tiny.py", "tinker_cookbook.rl.train", tmp_path)
    line = next(x for x in res.stdout.splitlines() if x.startswith("REWARDS "))
    rewards = [r for r in json.loads(line.removeprefix("REWARDS ")) if r is not None]
    assert len(rewards) == 12
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.3, rewards
    # the loop's final save went through save_weights / save_weights_for_sampler
    finals = sorted(p.parent.parent.name for p in (tmp_path / "ckpt").rglob("final/meta.json"))
    assert finals == ["sampler_weights", "weights"]


def test_cookbook_sl_basic_lowers_the_nll(tmp_path) -> None:
    _run("sl_tiny.py", "tinker_cookbook.recipes.sl_basic", tmp_path)
    with open(tmp_path / "log" / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 10  # the recipe's max_steps, one row per step
    # about 5.7 -> 3.1 (byte-level tokens, lr 1e-2); single batches vary (one hard batch
    # reaches ~10), so the first and last three are compared, and the last step to the first
    assert np.mean(nll[-3:]) < np.mean(nll[:3]) - 1.0, nll
    assert nll[-1] < nll[0] - 1.5, nll
    # the recipe's final save went through save_weights / save_weights_for_sampler
    finals = sorted(p.parent.parent.name for p in (tmp_path / "ckpt").rglob("final/meta.json"))
    assert finals == ["sampler_weights", "weights"]
    with open(tmp_path / "log" / "checkpoints.jsonl") as f:
        final = [json.loads(x) for x in f][-1]
    assert final["state_path"].endswith("/weights/final"), final
