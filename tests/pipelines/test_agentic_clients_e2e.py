"""`roll train agentic` trains agents written with the clients agent builders use, unchanged:
litellm streaming (examples/agents/litellm_agent.py), the Responses API and the anthropic client
(examples/agents/responses_agent.py, anthropic_agent.py), on the built-in tiny model for two
steps. Every generated token is trained with the sampler's own log-prob
(``train_infer/logprob_diff`` at float32 noise): token-in/token-out whatever the API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def recipe(tmp_path: Path, agent: str) -> Path:
    data = yaml.safe_load((ROOT / "recipes/tiny-calc-agent.yaml").read_text())
    data["runs_dir"] = str(tmp_path / "runs")
    data["envs"][0].update(agent=str(ROOT / "examples/agents" / agent) + ":run", groups_per_step=1)
    data["envs"][0]["eval_episodes"] = 0
    data["rollout"].update(group_size=2, chat_template=str(ROOT / data["rollout"]["chat_template"]))
    data["warm_start"].update(steps=2, episodes_per_step=2)
    data["trainer"]["max_steps"] = 2
    data["tracking"]["backends"] = ["jsonl"]
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("agent", "package"),
    [
        ("litellm_agent.py", "litellm"),
        ("responses_agent.py", "openai"),
        ("anthropic_agent.py", "anthropic"),
    ],
)
def test_agents_written_with_other_clients_train_token_in_token_out(
    roll, tmp_path: Path, agent: str, package: str
) -> None:
    pytest.importorskip(package)
    res = roll("train", "agentic", str(recipe(tmp_path, agent)), "--run-id", "c", timeout=300)
    assert res.returncode == 0, res.stderr + res.stdout
    logged = [json.loads(x) for x in (tmp_path / "runs/c/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if r.get("step") in (1, 2) and "perf/samples" in r]
    assert len(steps) == 2
    for step in steps:
        assert step["rollout/env_errors"] == 0 and step["rollout/env_timeouts"] == 0
        assert step["rollout/invalid_action_rate"] < 1.0
        assert step["rollout/generated_tokens_per_trajectory"] > 0
        assert step["train_infer/logprob_diff_max"] < 1e-4  # float32 noise
