"""Tiny rlvr and agentic recipes for the `roll view` tests (a few steps on the built-in model)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def rlvr_recipe(directory: Path, *, steps: int = 3, **sections: object) -> Path:
    """GRPO on arithmetic, 4 prompts x 4 samples a step, checkpoints every 2 steps."""
    recipe = {
        "pipeline": "rlvr",
        "name": "tiny-view-rlvr",
        "runs_dir": str(directory / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 64},
            "max_prompt_length": 64,
        },
        "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        "algorithm": {"preset": "grpo"},
        "trainer": {"max_steps": steps, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 3},
        "tracking": {"backends": ["jsonl"]},
    }
    recipe.update(sections)
    path = directory / "rlvr.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def agent_recipe(directory: Path) -> Path:
    """recipes/tiny-calc-agent.yaml made small: a warm start long enough that the policy calls
    the `calc` tool (about 40 s on 2 cores), then one RL step of 2 groups of 2 episodes."""
    data = yaml.safe_load((ROOT / "recipes/tiny-calc-agent.yaml").read_text())
    data["runs_dir"] = str(directory / "runs")
    data["envs"][0].update(
        agent=str(ROOT / "examples/agents/calculator_agent.py") + ":run",
        groups_per_step=2,
        eval_episodes=2,
    )
    data["rollout"].update(group_size=2, chat_template=str(ROOT / data["rollout"]["chat_template"]))
    data["warm_start"].update(steps=30, episodes_per_step=8)
    data["trainer"]["max_steps"] = 1
    data["eval"]["every_steps"] = None
    data["tracking"]["backends"] = ["jsonl"]
    path = directory / "agent.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
