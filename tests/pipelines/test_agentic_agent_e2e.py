"""End-to-end `roll train agentic` with a user's agent program (bring your own agent): the
example calculator agent (plain `openai`-client code) through the real CLI on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
AGENT = str(ROOT / "examples/agents/calculator_agent.py") + ":run"


def recipe(tmp_path: Path, agent: str = AGENT) -> Path:
    data = yaml.safe_load((ROOT / "recipes/tiny-calc-agent.yaml").read_text())
    data["runs_dir"] = str(tmp_path / "runs")
    data["envs"][0].update(agent=agent, groups_per_step=1, eval_episodes=2)
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


def test_agent_without_run_fails_before_a_run_exists(roll, tmp_path: Path) -> None:
    module = tmp_path / "my_agent.py"
    module.write_text("def play(client, task):\n    return 1.0\n")
    res = roll("train", "agentic", str(recipe(tmp_path, f"{module}:run")), "--run-id", "x")
    assert res.returncode == 2, res.stderr
    assert "agent module" in res.stderr and "has no function 'run'" in res.stderr
    assert "play" in res.stderr  # the functions it does have
    assert not (tmp_path / "runs" / "x").exists()


def test_agent_with_context_management_trains_segments_step_wise(roll, tmp_path: Path) -> None:
    """recipes/tiny-frozenlake-agent-lake.yaml: the FrozenLake agent sends only the current lake
    each call, so each call is its own segment, trained step-wise (GiGPO)."""
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
