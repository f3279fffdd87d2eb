"""tinker-cookbook's own RL loop (``tinker_cookbook.rl.train.main``, unchanged) against the
real `roll serve`: tests/serve/cookbook/rl_tiny.py gives it a cookbook-style env the tiny model
can learn; the mean reward rises.

tinker-cookbook 0.6.1 needs ``tml-renderers>=0.4.1``, which not every package index has; the
RL loop itself does not import it. The test runs the script with ``ROLL_COOKBOOK_PYTHON`` (an
interpreter that imports ``tinker_cookbook``, e.g. a venv with ``pip install --no-deps
tinker-cookbook==0.6.1 chz blobfile pyrage termcolor``), or this interpreter; this
interpreter's site-packages come after the script's own, so roll, torch and tinker are found.
Skipped when neither imports the cookbook."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.serve.test_serve_tinker import Server

pytest.importorskip("tinker", reason="the tinker client is not installed")
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "serve" / "cookbook" / "rl_tiny.py"


def _cookbook_python() -> tuple[str, dict[str, str]]:
    python = os.environ.get("ROLL_COOKBOOK_PYTHON") or sys.executable
    paths = [str(ROOT), *site.getsitepackages()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TINKER_API_KEY": "tml-local"}
    env["OMP_NUM_THREADS"] = "1"
    probe = subprocess.run(
        [python, "-c", "import tinker_cookbook.rl.train"], env=env, capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(
            "tinker-cookbook is not importable (set ROLL_COOKBOOK_PYTHON to an interpreter "
            "with tinker-cookbook 0.6.1; see this module's docstring)"
        )
    return python, env


def test_cookbook_rl_loop_raises_the_reward(tmp_path) -> None:
    python, env = _cookbook_python()
    srv = Server(tmp_path / "ckpt", tmp_path / "cache")
    try:
        res = subprocess.run(
            [python, str(SCRIPT), srv.url, str(tmp_path / "log")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        srv.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("REWARDS "))
    rewards = [r for r in json.loads(line.removeprefix("REWARDS ")) if r is not None]
    assert len(rewards) == 12
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.3, rewards
    # the loop's final save went through save_weights / save_weights_for_sampler
    finals = sorted(p.parent.parent.name for p in (tmp_path / "ckpt").rglob("final/meta.json"))
    assert finals == ["sampler_weights", "weights"]
