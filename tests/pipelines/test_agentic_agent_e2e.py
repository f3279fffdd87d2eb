"""End-to-end `roll train agentic` with a user's agent program (bring your own agent): the
example calculator agent (plain `openai`-client code) through the real CLI on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
AGENT = str(ROOT / "examples/agents/calculator_agent.py") + ":run"


def recipe(tmp_path: Path, agent: str = AGENT, options: dict | None = None) -> Path:
    data = yaml.safe_load((ROOT / "recipes/tiny-calc-agent.yaml").read_text())
    data["runs_dir"] = str(tmp_path / "runs")
    data["envs"][0].update(agent=agent, groups_per_step=1, eval_episodes=2)
    if options is not None:
        data["envs"][0]["options"] = options
    data["rollout"].update(group_size=2, chat_template=str(ROOT / data["rollout"]["chat_template"]))
    data["warm_start"].update(steps=1, episodes_per_step=2)
    data["trainer"]["max_steps"] = 1
    data["eval"]["every_steps"] = 1
    data["tracking"]["backends"] = ["jsonl"]
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_train_agentic_with_an_openai_client_agent(roll, tmp_path: Path) -> None:
    res = roll("train", "agentic", str(recipe(tmp_path)), "--run-id", "ag", timeout=240)
    assert res.returncode == 0, res.stderr + res.stdout
    logged = [json.loads(x) for x in (tmp_path / "runs/ag/metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in logged if r["step"] == 1]
    assert step["rollout/env_errors"] == 0 and step["rollout/env_timeouts"] == 0
    assert step["rollout/episode_length"] >= 1 and step["perf/samples"] == 2
    assert step["rollout/generated_tokens_per_trajectory"] > 0
    # every generated token of every call: the trainer's log-prob equals the sampler's
    assert step["train_infer/logprob_diff_max"] < 1e-3
    assert "eval/success_rate" in step
    assert any(r.get("warm_start/env_errors") == 0 for r in logged)
    assert "envs: calculator_agent (1 groups/step)" in res.stderr


RETRIER = """
import openai


def run(client, task):
    messages = [{"role": "user", "content": "2*3"}]
    answer = client.chat.completions.create(model="policy", messages=messages)
    messages += [answer.choices[0].message, {"role": "user", "content": "x" * 5000}]
    for _ in range(4):  # a call that cannot fit the context, and 3 retries of it
        try:
            client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError:
            continue
    return 0.5 if task["seed"] % 2 else 0.0
"""


def test_a_call_refused_for_the_context_and_its_retries_are_not_trained(
    roll, tmp_path: Path
) -> None:
    """An agent sends a 5,000-token message to the 512-token model, then retries it 3 times:
    each episode trains exactly its one served call (one row, inside the context)."""
    module = tmp_path / "retrier.py"
    module.write_text(RETRIER)
    path = recipe(tmp_path, f"{module}:run", options={})
    data = yaml.safe_load(path.read_text())
    data["warm_start"]["steps"] = 0
    data["envs"][0]["eval_episodes"] = 0
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    res = roll("train", "agentic", str(path), "--run-id", "rt", timeout=240)
    assert res.returncode == 0, res.stderr + res.stdout
    logged = [json.loads(x) for x in (tmp_path / "runs/rt/metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in logged if r["step"] == 1]
    assert step["rollout/env_errors"] == 0 and step["rollout/context_truncated_rate"] == 1.0
    # 2 episodes, one served call each: 2 rows, no prompt-only row of a refused call
    assert step["perf/samples"] == 2 and step["rollout/segments_per_episode"] == 1
    assert step["rollout/episode_length"] == 1
    assert 0 < step["rollout/generated_tokens_per_trajectory"] <= 72  # max_new_tokens
    assert step["rollout/tokens_per_trajectory"] < 100  # the short first call, not 5,000
    assert step["rollout/rows_dropped_no_generated"] == step["rollout/rows_dropped_too_long"] == 0


def test_agent_without_run_fails_before_a_run_exists(roll, tmp_path: Path) -> None:
    module = tmp_path / "my_agent.py"
    module.write_text("def play(client, task):\n    return 1.0\n")
    res = roll("train", "agentic", str(recipe(tmp_path, f"{module}:run")), "--run-id", "x")
    assert res.returncode == 2, res.stderr
    assert "agent module" in res.stderr and "has no function 'run'" in res.stderr
    assert "play" in res.stderr  # the functions it does have
    assert not (tmp_path / "runs" / "x").exists()


def test_bad_agent_options_and_a_failing_make_task_are_the_users_errors(
    roll, tmp_path: Path
) -> None:
    """An option make_task has no parameter for (a typo) is a recipe error with did-you-mean;
    a make_task that raises is told as the agent's error, at its own line; neither is 'a bug
    in roll', and both stop before a run directory exists."""
    typo = recipe(tmp_path, options={"lowe": 4, "high": 9})
    res = roll("train", "agentic", str(typo), "--run-id", "t")
    err = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stderr
    assert "calculator_agent.py:run': envs[].options do not fit make_task(seed, low=10, " in err
    assert "unknown option 'lowe' (did you mean 'low'?)" in err and "takes: low, high" in err
    raising = recipe(tmp_path, options={"low": 40, "high": 9})  # randint(40, 9) raises
    res = roll("train", "agentic", str(raising), "--run-id", "r")
    err = " ".join(res.stderr.split())
    assert res.returncode == 1, res.stderr
    assert "calculator_agent.py:run': make_task(0, low=40, high=9)" in err
    assert "failed: ValueError: empty range for randrange()" in err
    assert "calculator_agent.py:39, in make_task)" in err  # the agent's line, not random.py's
    assert "Fix make_task in " in err
    checked = roll("validate", str(raising))  # the same check, without a run
    assert checked.returncode == 1 and "make_task(0, low=40, high=9)" in checked.stderr
    for out in (res.stderr, checked.stderr):
        assert "bug in roll" not in out and "Traceback" not in out
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("mode", ["step", "trajectory"])
def test_agent_with_context_management_trains_segments(roll, tmp_path: Path, mode: str) -> None:
    """recipes/tiny-frozenlake-agent-lake.yaml: the FrozenLake agent sends only the current lake
    each call, so each call is its own segment, trained step-wise (GiGPO) or one row per
    segment (trajectory mode: GRPO counts each episode once in its group)."""
    data = yaml.safe_load((ROOT / "recipes/tiny-frozenlake-agent-lake.yaml").read_text())
    data["runs_dir"] = str(tmp_path / "runs")
    data["envs"][0].update(
        agent=str(ROOT / "examples/agents/frozenlake_agent.py") + ":run",
        groups_per_step=1,
        eval_episodes=2,
    )
    data["rollout"].update(group_size=2, chat_template=str(ROOT / data["rollout"]["chat_template"]))
    data["warm_start"].update(steps=1, episodes_per_step=2)
    data["trainer"]["max_steps"] = 1
    data["eval"]["every_steps"] = 1
    data["tracking"]["backends"] = ["jsonl"]
    if mode == "trajectory":
        data["rollout"]["mode"] = "trajectory"
        data["algorithm"] = {"preset": "grpo", "kl": {"coef": 0.0}}
    path = tmp_path / "lake.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    res = roll("train", "agentic", str(path), "--run-id", "lk", timeout=240)
    assert res.returncode == 0, res.stderr + res.stdout
    logged = [json.loads(x) for x in (tmp_path / "runs/lk/metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in logged if r["step"] == 1]
    assert step["rollout/env_errors"] == 0 and step["rollout/env_timeouts"] == 0
    # every call sends only the lake: one segment per call (a continuing call would append)
    assert step["rollout/segments_per_episode"] == step["rollout/episode_length"]
    assert step["perf/samples"] == round(2 * step["rollout/episode_length"])  # a row per call
    assert step["train_infer/logprob_diff_max"] < 1e-3
