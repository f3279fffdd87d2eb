"""`roll validate` and `roll train agentic` with the real Qwen vocabulary and the public Qwen3 /
Qwen2.5 chat templates on a random-init tiny Qwen3 (issue 32, item 3): Qwen3's template rewrites
history, which must neither crash the run nor pass validation where it cannot be trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.qwen_real import TEMPLATES

DROPS_ASSISTANT = (  # a template that never writes an assistant turn's text
    "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def recipe(tmp_path: Path, model: Path, **rollout: object) -> Path:
    data = {
        "pipeline": "agentic",
        "name": "qwen-real",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(model)},
        "envs": [
            {
                "env": "frozen_lake",
                "options": {"size": 3, "max_steps": 2},
                "system_prompt": "Lake.",
                "groups_per_step": 1,
                "eval_episodes": 1,
            }
        ],
        "rollout": {"group_size": 2, "max_new_tokens": 4, **rollout},
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}},
        "trainer": {"max_steps": 1, "micro_batch_size": 4},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "eval": {"every_steps": None},
        "checkpoint": {"every_steps": None},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.slow
def test_validate_checks_the_template_for_the_mode(roll, tmp_path: Path, qwen_real) -> None:
    model = qwen_real("qwen3")
    res = roll("validate", str(recipe(tmp_path, model, mode="trajectory")))
    assert res.returncode == 0, res.stderr  # Qwen3 rewrites history: trained token-in/out
    bad = tmp_path / "drops.jinja"
    bad.write_text(DROPS_ASSISTANT)
    path = recipe(tmp_path, model, chat_template=str(bad))
    res = roll("validate", str(path))
    assert res.returncode == 2, res.stderr + res.stdout
    assert "rollout.mode=trajectory" in res.stderr and "rollout.mode: step" in res.stderr
    assert "Traceback" not in res.stderr and "bug in roll" not in res.stderr
    res = roll("validate", str(path), "rollout.mode=step", "rollout.history_window=0")
    assert res.returncode == 0, res.stderr  # no turn is ever appended: trainable


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "rollout"),
    [
        ("qwen3", {"mode": "step", "history_window": 0}),
        # the model ships Qwen2.5's template; rollout.chat_template replaces it with Qwen3's
        pytest.param(  # extended: the second real template run (the first runs by default)
            "qwen3-tpl2.5",
            {"mode": "trajectory", "chat_template": str(TEMPLATES["qwen3"])},
            marks=pytest.mark.extended,
        ),
    ],
)
def test_train_agentic_real_qwen3(roll, tmp_path: Path, qwen_real, kind, rollout) -> None:
    path = recipe(tmp_path, qwen_real(kind), **rollout)
    # any gap above 1e-30 warns: the warning's end-to-end path (issue 32, item 5)
    res = roll(
        "train",
        "agentic",
        str(path),
        "trainer.warn_logprob_diff=1e-30",
        "--run-id",
        "q",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    rows = [json.loads(x) for x in (tmp_path / "runs/q/metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1][0]
    assert step["train_infer/logprob_diff"] < 1e-3
    assert step["train_infer/logprob_diff"] <= step["train_infer/logprob_diff_max"] < 1e-2
    warned = step["train_infer/logprob_diff"] > 1e-30
    assert res.stderr.count("above trainer.warn_logprob_diff=1e-30") == int(warned)
    # the trajectory run says how it trains a template that rewrites history
    assert ("rewrites earlier turns" in res.stderr) == (rollout["mode"] == "trajectory")
