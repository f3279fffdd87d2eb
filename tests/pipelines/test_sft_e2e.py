"""End-to-end: the real `roll` CLI in a subprocess on the built-in tiny model.

The exactness tests compare final weights bitwise: a run killed with SIGKILL (also once in the
middle of a checkpoint save) and resumed must end with the same bytes as a run never stopped.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_cli_env, make_roll, write_tiny_recipe

pytestmark = pytest.mark.slow


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return {r["step"]: r["train/loss"] for r in rows}


def final_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


@pytest.fixture(scope="module")
def baseline(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 12-step run for the whole module (it was run once per test): the tests
    only read it; the one that damages a checkpoint works on its own copy."""
    directory = tmp_path_factory.mktemp("baseline")
    recipe = write_tiny_recipe(directory)
    res = make_roll(make_cli_env(cache_dir))("sft", str(recipe), "--run-id", "base-line-00")
    assert res.returncode == 0, res.stderr
    return directory / "runs" / "base-line-00"


def test_sft_run_layout_and_hf_export(baseline: Path, roll) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert steps_logged(baseline) == list(range(1, 13))
    meta = json.loads((baseline / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["step"] == 12
    assert meta["command"][1:3] == ["sft", meta["recipe"]]
    assert "eval/exact_match" in meta["metrics"]
    ckpts = sorted(p.name for p in (baseline / "checkpoints").glob("step-*"))
    assert ckpts == ["step-000004", "step-000008", "step-000012"]
    assert (baseline / "checkpoints" / "latest").read_text().strip() == "step-000012"
    model = AutoModelForCausalLM.from_pretrained(baseline / "final")
    tok = AutoTokenizer.from_pretrained(baseline / "final")
    assert model.config.model_type == "qwen3" and tok.eos_token == "<|im_end|>"
    listing = roll("runs", "--runs-dir", str(baseline.parent))
    assert (
        listing.returncode == 0
        and "base-line-00" in listing.stdout
        and "finished" in listing.stdout
    )


def _start(recipe: Path, run_id: str, env: dict[str, str]) -> subprocess.Popen:
    roll_bin = str(Path(sys.executable).parent / "roll")
    return subprocess.Popen(
        [roll_bin, "sft", str(recipe), "--run-id", run_id],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (
            (run_dir / "metrics.jsonl").exists()
            and steps_logged(run_dir)
            and steps_logged(run_dir)[-1] >= step
        ):
            return
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "exited"
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def test_sigkill_then_resume_is_bitwise_identical(
    baseline, roll, tiny_recipe, cli_env, tmp_path
) -> None:
    recipe = tiny_recipe()
    run_dir = tmp_path / "runs" / "kill-me-01"
    proc = _start(recipe, "kill-me-01", cli_env)
    _wait_for_step(run_dir, 6, proc)  # checkpoint step-4 exists; steps 5-6 will be redone
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "running"
    res = roll("resume", "kill-me-01", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    assert "resumed from step-000004" in res.stderr or "resumed from step-000008" in res.stderr
    assert steps_logged(run_dir) == list(range(1, 13))  # continuous, no duplicates
    assert losses(run_dir) == losses(baseline)
    assert_same_weights(final_weights(run_dir), final_weights(baseline))


@pytest.mark.extended  # a second kill point; SIGKILL then bit-for-bit resume runs by default
def test_kill_during_checkpoint_save(baseline, roll, tiny_recipe, cli_env, tmp_path) -> None:
    recipe = tiny_recipe()
    run_dir = tmp_path / "runs" / "kill-save-02"
    res = roll("sft", str(recipe), "--run-id", "kill-save-02", env={"ROLL_DEBUG_KILL_IN_SAVE": "8"})
    assert res.returncode == -signal.SIGKILL
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000004"
    assert list((run_dir / "checkpoints").glob(".tmp-step-000008-*"))  # the torn save is there
    res = roll("resume", "kill-save-02", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    assert "resumed from step-000004" in res.stderr
    assert steps_logged(run_dir) == list(range(1, 13))
    assert_same_weights(final_weights(run_dir), final_weights(baseline))


def test_damaged_checkpoint_falls_back(baseline, roll, tmp_path: Path) -> None:
    # Corrupt the newest checkpoint of (a copy of) the finished baseline and resume it: it must
    # fall back to step 8, redo steps 9-12 and end with the same weights.
    before = final_weights(baseline)
    baseline = Path(shutil.copytree(baseline, tmp_path / "runs" / baseline.name))
    weights = baseline / "checkpoints" / "step-000012" / "actor_train" / "rank-0" / "optimizer.pt"
    weights.write_bytes(b"garbage")
    res = roll("resume", "base-line-00", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    assert "checkpoint step-000012 is damaged" in res.stderr
    assert "falling back to step-000008" in res.stderr
    assert steps_logged(baseline) == list(range(1, 13))
    assert_same_weights(final_weights(baseline), before)
    # Resuming against different training data is refused, and nothing is touched.
    res = roll(
        "resume", "base-line-00", "data.train.max_rows=256", "--runs-dir", str(tmp_path / "runs")
    )
    assert res.returncode == 1 and "training data changed since step-000012" in res.stderr
    assert "Traceback" not in res.stderr
    assert json.loads((baseline / "meta.json").read_text())["status"] == "finished"
    assert "max_rows: 256" not in (baseline / "config.yaml").read_text()
    # A finished run has nothing to resume unless max_steps grows.
    res = roll("resume", "base-line-00", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 2 and "already reached trainer.max_steps=12" in res.stderr
    assert json.loads((baseline / "meta.json").read_text())["status"] == "finished"


def test_ctrl_c_marks_interrupted_and_prints_resume(roll, tiny_recipe, cli_env, tmp_path) -> None:
    recipe = tiny_recipe(trainer={"max_steps": 400, "micro_batch_size": 8})
    run_dir = tmp_path / "runs" / "ctrl-c-03"
    proc = _start(recipe, "ctrl-c-03", cli_env)
    _wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "roll resume ctrl-c-03" in stderr
    assert "stopped: run ctrl-c-03 stopped at step" in stderr  # asked for: not an error
    assert "error:" not in stderr
    assert "Traceback" not in stderr
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "interrupted"
    stopped = meta["step"]
    assert (run_dir / "checkpoints" / f"step-{stopped:06d}").is_dir()
    res = roll(
        "resume",
        "ctrl-c-03",
        "trainer.max_steps=" + str(stopped + 2),
        "--runs-dir",
        str(tmp_path / "runs"),
    )
    assert res.returncode == 0, res.stderr
    assert steps_logged(run_dir) == list(range(1, stopped + 3))


@pytest.mark.ray
def test_local_and_ray_executors_give_the_same_loss_curve(
    baseline, roll, tiny_recipe, tmp_path
) -> None:
    recipe = tiny_recipe(executor={"type": "ray", "num_cpus": 2})
    res = roll("sft", str(recipe), "--run-id", "on-ray-04")
    assert res.returncode == 0, res.stderr
    ray_dir = tmp_path / "runs" / "on-ray-04"
    assert losses(ray_dir) == losses(baseline)
    assert_same_weights(final_weights(ray_dir), final_weights(baseline))
