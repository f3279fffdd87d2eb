"""GEM envs (gem-llm) behind the text protocol: offline games and a ReasoningGym task with GEM's
Python tool, and `roll debug-env gem:...` in a subprocess."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from roll_core.envs import make_env
from roll_core.envs.base import env_id, observation_tool_results
from roll_core.errors import ConfigError

pytest.importorskip("gem")  # in the dev extra and the lock: present wherever roll's tests run
GUESS = "gem:game:GuessTheNumber-v0-easy"


def test_guess_the_number_plays_to_a_win_by_bisection() -> None:
    env = make_env(GUESS)
    assert env_id(type(env)) == GUESS
    obs, info = env.reset(3)
    assert "between 1 and 10" in obs and obs.endswith("Enter your next guess.")  # GEM's suffix
    low, high = 1, 10
    for _ in range(4):
        guess = (low + high) // 2
        result = env.step(f"I guess \\boxed{{{guess}}}")
        if result.terminated:
            break
        assert result.info["action_is_valid"] and result.reward == 0.0
        hint = re.search(r"target number is (higher|lower)", result.observation).group(1)  # type: ignore[union-attr]
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
    assert result.terminated and result.reward == 1.0 and result.info["success"]
    assert "Congratulations" in result.observation


def test_a_seed_gives_the_same_episode_whatever_runs_beside_it() -> None:
    def episode(seed: int) -> list[str]:
        env = make_env(GUESS)
        seen = [env.reset(seed)[0]]
        rng = np.random.default_rng(seed)
        while not env.done:
            seen.append(env.step(env.random_action(rng)).observation)
        return seen

    alone = [episode(s) for s in range(6)]
    random.seed(123)
    state = random.getstate()
    with ThreadPoolExecutor(4) as pool:  # interleaved episodes share GEM's global generators
        together = list(pool.map(episode, [s for s in range(6) for _ in range(3)]))
    assert together == [a for a in alone for _ in range(3)]
    assert random.getstate() == state  # the process's own generator is left as it was
    assert len({tuple(a) for a in alone}) > 1


def test_a_reasoning_gym_task_with_gems_python_tool() -> None:
    env = make_env("gem:rg:simple_equations", kwargs={"size": 8}, tool_wrappers=["python_tool"])
    obs, _ = env.reset(1)
    assert "<python>" in obs  # GEM's tool instructions
    result = env.step("<python>print(6 * 7)</python>")
    (tool,) = observation_tool_results(result.observation)
    assert tool.name == "python_code" and "42" in tool.content
    assert not result.terminated
    answer = env.step("\\boxed{-1000}")
    assert answer.terminated and not answer.info["success"]


def test_bad_names_and_options() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'game:GuessTheNumber-v0-easy'"):
        make_env("gem:game:GuessTheNumbr-v0-easy")
    with pytest.raises(ConfigError, match="unknown GEM tool wrapper 'concat'"):
        make_env(GUESS, tool_wrappers=["concat"]).reset(0)
    with pytest.raises(ConfigError, match="unknown option 'kwarg'"):
        make_env(GUESS, kwarg={})


@pytest.mark.slow
def test_debug_env_plays_a_gem_env_in_a_subprocess(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "roll_cli.main", "debug-env", GUESS, "--policy", "random"]
        + ["--seed", "1", "--episodes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert "episode 1/2 · gem:game:GuessTheNumber-v0-easy · seed 1 · random" in out.stdout
    assert "2 episodes: success rate" in out.stdout
    assert "\\boxed{" in out.stdout  # GEM's own random actions


@pytest.mark.slow
def test_train_agentic_on_a_gem_env(roll, tmp_path) -> None:
    """One step of `roll train agentic` with a GEM game: multi-turn episodes, GEM's rewards."""
    import json

    import yaml

    data = {
        "pipeline": "agentic",
        "name": "tiny-gem-test",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "envs": [
            {
                "env": GUESS,
                "options": {"instructions": False, "max_steps": 3},
                "system_prompt": "Guess 1-10 as \\boxed{N}.",
                "groups_per_step": 2,
                "eval_episodes": 2,
            }
        ],
        "rollout": {"group_size": 2, "max_new_tokens": 12, "chunk_size": 8},
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}},
        "warm_start": {"steps": 2, "episodes_per_step": 8, "lr": 5.0e-3},
        "trainer": {"max_steps": 1, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "eval": {"every_steps": None},
        "checkpoint": {"every_steps": None},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "gem.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    res = roll("train", "agentic", str(path), "--run-id", "gem", timeout=240)
    assert res.returncode == 0, res.stderr + res.stdout
    rows = [
        json.loads(x)
        for x in (tmp_path / "runs" / "gem" / "metrics.jsonl").read_text().splitlines()
    ]
    step = next(r for r in rows if r["step"] == 1)
    assert step["perf/samples"] == 2 * 2  # trajectory mode: one row per episode
    assert step["rollout/env_errors"] == 0 and step["rollout/invalid_action_rate"] == 0
    assert 1 <= step["rollout/episode_length"] <= 3
    assert abs(step["train_infer/logprob_diff"]) < 1e-3


def test_without_gem_installed_the_error_says_what_to_install(monkeypatch) -> None:
    from roll_core.envs import gem_adapter

    monkeypatch.setitem(sys.modules, "gem", None)  # `import gem` raises ImportError
    monkeypatch.setattr(gem_adapter, "_CLASSES", {})
    with pytest.raises(ConfigError, match="need the gem-llm package") as err:
        make_env(GUESS)
    assert "pip install 'roll[gem]'" in (err.value.hint or "")
