"""`roll train agentic` with a user env that raises and hangs: the run finishes with the faults
counted (warm start, training and validation), or stops with a message that says what happened."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import yaml

FLAKY = textwrap.dedent(
    """
    import itertools
    import threading
    import time

    from pydantic import Field

    from roll_core.envs import EnvOptions, TextEnv, Transition, parse_choice

    _CALLS = itertools.count()
    _LOCK = threading.Lock()
    # of every 20 step calls (in the process), 4 raise (20%) and 1 hangs (5%)
    _RAISE, _HANG = {3, 7, 11, 15}, {9}


    class FlakyOptions(EnvOptions):
        always_raise: bool = Field(False, description="Every step raises.")


    class Flaky(TextEnv):
        Options = FlakyOptions
        instructions = "Say left or right."

        def on_reset(self, rng):
            return "Left or right?", {}

        def parse_action(self, text):
            return parse_choice(text, {"left": "left", "right": "right"})

        def step(self, action):  # every step call, valid action or not, may fail
            with _LOCK:
                n = next(_CALLS) % 20
            if self.options.always_raise or n in _RAISE:
                self.fail()
            if n in _HANG:
                time.sleep(120)
            return super().step(action)

        def fail(self):
            raise RuntimeError(f"flaky step {self.steps + 1}")

        def on_step(self, action):
            return Transition("ok", float(action == "right"), False, {"success": action == "right"})

        def render(self):
            return "flaky"

        def valid_actions(self):
            return ["left", "right"]
    """
)


def _recipe(tmp_path: Path, **sections: object) -> Path:
    (tmp_path / "flaky_env.py").write_text(FLAKY)
    data: dict = {
        "pipeline": "agentic",
        "name": "flaky",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "envs": [
            {
                "env": "flaky_env:Flaky",
                "options": {"max_steps": 2},
                "system_prompt": "Say left or right.",
                "groups_per_step": 2,
                "eval_episodes": 16,
            }
        ],
        "rollout": {
            "group_size": 2,
            "max_new_tokens": 4,
            "step_timeout_s": 0.5,
        },
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}},
        "warm_start": {"steps": 1, "episodes_per_step": 4},
        "trainer": {"max_steps": 2, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "eval": {"every_steps": 2},
        "tracking": {"backends": ["jsonl"]},
    }
    data.update(sections)
    path = tmp_path / "flaky.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def _total(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows)


def test_run_with_occasional_env_faults_finishes_and_counts_them(roll, tmp_path: Path) -> None:
    res = roll(
        "train", "agentic", str(_recipe(tmp_path)), "--run-id", "f", cwd=tmp_path, timeout=300
    )
    assert res.returncode == 0, res.stderr + res.stdout
    rows = _rows(tmp_path / "runs" / "f")
    # the default budget (max_replacements = group_size) absorbs 25% faulty steps
    assert [r["step"] for r in rows if r["step"] > 0 and "actor/pg_loss" in r] == [1, 2]
    assert _total(rows, "warm_start/env_errors") + _total(rows, "warm_start/env_timeouts") >= 1
    assert _total(rows, "rollout/env_errors") >= 1
    # the first 3 faults' text is on the console (the rest only counted)
    shown = re.findall(r"warning: (?:training|validation) episode of flaky failed", res.stderr)
    assert len(shown) == 3, res.stderr
    assert "(error): RuntimeError: flaky step" in " ".join(res.stderr.split())
    # validation at steps 0 and 2 (16 episodes of 2 steps each): ~1 fault per 4 steps
    assert _total(rows, "eval/env_errors") >= 1
    assert _total(rows, "eval/env_errors") + _total(rows, "eval/env_timeouts") <= 32
    assert (
        _total(rows, "rollout/env_timeouts")
        + _total(rows, "eval/env_timeouts")
        + _total(rows, "warm_start/env_timeouts")
    ) >= 1


def test_faults_beyond_the_budget_stop_the_run_with_the_env_error(roll, tmp_path: Path) -> None:
    recipe = _recipe(
        tmp_path,
        envs=[
            {
                "env": "flaky_env:Flaky",
                "options": {"max_steps": 2, "always_raise": True},
                "groups_per_step": 2,
                "eval_episodes": 0,
            }
        ],
        warm_start={"steps": 0},
    )
    res = roll("train", "agentic", str(recipe), "--run-id", "s", cwd=tmp_path, timeout=300)
    assert res.returncode == 1, res.stderr + res.stdout
    err = " ".join(res.stderr.split())
    assert "bug in roll" not in err
    assert "env flaky failed too often" in err
    # every failed episode raised at its first step; 2 groups needed, 2*2+2 failed groups
    # allowed, so the 7th failed group stops the run: 7 groups x (2 + 2 replacements) episodes
    # (groups still running when it stops add their failures too)
    found = re.search(r"(\d+) of its episodes failed \((\d+) raised, 0 timed out\) and 0 comp", err)
    assert found and found[1] == found[2] and int(found[1]) >= 28, err
    # the env's own message and the line that raised it, in the user's file
    assert "First error: RuntimeError: flaky step 1 (at flaky_env.py:" in err
    assert ", in fail)" in err and "rollout.max_replacements" in err
    rows = _rows(tmp_path / "runs" / "s")
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["rollout/env_errors"] == rows[0]["rollout/flaky/env_errors"] == int(found[1])
