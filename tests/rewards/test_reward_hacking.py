"""The reward-hacking suite: each known cheat, submitted through ``CodeReward``, scores 0.

Each mode runs ``tests/rewards/reward_hacks.py`` once, as a driver process of its own (both
modes at once, every program of a mode concurrently: about 10 s in all): the driver holds
the expected output in its memory, its initial environment, a file and three sockets, and
is the target of the signalling cheats (see that module). Here, per mode and per cheat:
the cheat scores 0, the honest program scores 1 before and after every cheat ran, the
driver survived, its sockets saw no connection, and no process, file, socket or sandbox
directory is left.

As root (CI) programs run as ``run_as_uid``. The ordinary-user variant runs the same driver
as another user; it needs that user and an interpreter with roll's dependencies that the
user can run (the nox virtualenv under /root is not), so it is opt-in:

    useradd -m rolltest
    setpriv --reuid=rolltest --regid=rolltest --init-groups \\
        sh -c 'python3 -m venv ~/venv && ~/venv/bin/pip install pydantic pyyaml math-verify'
    ROLL_HACK_USER=rolltest ROLL_HACK_USER_PYTHON=/home/rolltest/venv/bin/python \\
        python -m pytest tests/rewards/test_reward_hacking.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from roll_core.rewards.sandbox import landlock_abi, namespaces_available

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_spec = importlib.util.spec_from_file_location("reward_hacks", HERE / "reward_hacks.py")
assert _spec is not None and _spec.loader is not None
reward_hacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reward_hacks)
CHEATS = reward_hacks.CHEATS

MODES = ["namespaces", "rlimits"]
USER = os.environ.get("ROLL_HACK_USER")
USER_PYTHON = os.environ.get("ROLL_HACK_USER_PYTHON")


def _start(mode: str, as_user: bool) -> tuple[subprocess.Popen[str], str]:
    secret = f"ANS-{uuid.uuid4().hex}"
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "ROLL_HACK_SECRET": secret,  # in the driver's initial environment (/proc/<pid>/environ)
        "HOME": os.environ.get("HOME", "/"),
    }
    cmd = [sys.executable, str(HERE / "reward_hacks.py"), "--mode", mode]
    if as_user:
        assert USER and USER_PYTHON
        env["HOME"] = os.path.expanduser(f"~{USER}")
        cmd = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--init-groups", USER_PYTHON]
        cmd += [str(HERE / "reward_hacks.py"), "--mode", mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc, secret


def _collect(runs: dict[str, tuple[subprocess.Popen[str], str]]) -> dict[str, dict]:
    reports = {}
    for mode, (proc, _) in runs.items():
        out, err = proc.communicate(timeout=300)
        # a driver that was killed (a signal got through) prints no report
        assert proc.returncode == 0, f"{mode}: the driver died ({proc.returncode}): {err[-2000:]}"
        reports[mode] = json.loads(out)
    return reports


def _modes() -> list[str]:
    ok, _ = namespaces_available()
    return MODES if ok else ["rlimits"]


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return _collect({mode: _start(mode, False) for mode in _modes()})


@pytest.fixture(scope="module")
def user_reports() -> dict[str, dict]:
    if not (USER and USER_PYTHON):
        pytest.skip("set ROLL_HACK_USER and ROLL_HACK_USER_PYTHON (see the module docstring)")
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root")
    return _collect({mode: _start(mode, True) for mode in _modes()})


def _known_hole(mode: str) -> None:
    """rlimits mode hides files and /proc only through Landlock (docs/rewards.md)."""
    if mode == "rlimits" and landlock_abi() == 0:
        pytest.xfail("rlimits mode without Landlock does not hide readable files or /proc")


def _check_run(report: dict, mode: str) -> None:
    assert report["mode"] == mode  # no silent fallback
    results = report["results"]
    for honest in ("honest", "honest_after"):
        assert results[honest]["score"] == 1.0, (honest, results[honest])
    assert report["socket_connections"] == 0
    assert report["leftovers"] == []


@pytest.mark.parametrize("mode", MODES)
def test_honest_program_scores_one_and_nothing_is_left(reports, mode: str) -> None:
    if mode not in reports:
        pytest.skip(f"namespaces mode unavailable here: {namespaces_available()[1]}")
    if reports[mode]["leftovers"]:
        _known_hole(mode)
    _check_run(reports[mode], mode)


@pytest.mark.parametrize("cheat", sorted(CHEATS))
@pytest.mark.parametrize("mode", MODES)
def test_cheat_scores_zero(reports, mode: str, cheat: str) -> None:
    if mode not in reports:
        pytest.skip(f"namespaces mode unavailable here: {namespaces_available()[1]}")
    result = reports[mode]["results"][cheat]
    if result["score"] != 0.0:
        _known_hole(mode)
    assert result["score"] == 0.0, result
    assert result["statuses"] != ["pass"], result


@pytest.mark.parametrize("mode", MODES)
def test_as_an_ordinary_user(user_reports, mode: str) -> None:
    if mode not in user_reports:
        pytest.skip(f"namespaces mode unavailable here: {namespaces_available()[1]}")
    report = user_reports[mode]
    assert report["uid"] != 0
    _check_run(report, mode)
    scores = {name: r["score"] for name, r in report["results"].items() if name in CHEATS}
    assert scores == dict.fromkeys(CHEATS, 0.0)


@pytest.mark.slow
def test_cheats_score_zero_through_roll_train_rlvr(roll, tmp_path: Path) -> None:
    """The tiny multi-domain recipe, one step; each (mode, program) is a domain of its own,
    scored in the training driver (``isolation: thread``) by
    ``reward_hacks:program_from_row``."""
    secret = f"ANS-{uuid.uuid4().hex}"
    names = ["honest", *sorted(CHEATS)]
    domains, rows = {}, []
    for mode in _modes():
        for name in names:
            domain = f"{mode}_{name}"
            rows.append(
                {"prompt": f"{domain}:", "answer": secret, "domain": domain, "program": name}
            )
            domains[domain] = {
                "rewards": [{"name": "reward_hacks:program_from_row", "args": {"mode": mode}}],
                "isolation": "thread",
                "timeout_s": 60,
            }
    data = tmp_path / "hacks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = roll(
        "train",
        "rlvr",
        "recipes/tiny-multidomain-rlvr.yaml",
        "trainer.max_steps=1",
        "eval.every_steps=100",
        "checkpoint.every_steps=100",
        f"data.train.path={data}",
        f"data.eval.path={data}",
        f"rollout.prompts_per_step={len(rows)}",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        f"reward.domains={json.dumps(domains)}",
        f"runs_dir={tmp_path}",
        "--run-id",
        "hacks",
        env={"ROLL_HACK_SECRET": secret, "PYTHONPATH": f"{ROOT}:{HERE}"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "hacks" / "metrics.jsonl").read_text().splitlines()
    key = f"reward/{_modes()[0]}_honest/mean"
    step = next(m for m in map(json.loads, lines) if key in m)
    for mode in _modes():
        assert step[f"reward/{mode}_honest/mean"] == 1.0, mode
        for name in CHEATS:
            assert step[f"reward/{mode}_{name}/count"] >= 1.0, (mode, name)
            assert step[f"reward/{mode}_{name}/mean"] == 0.0, (mode, name)
