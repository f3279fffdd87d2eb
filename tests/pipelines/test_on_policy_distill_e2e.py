"""End-to-end on-policy distillation: `roll train rlvr` with `algorithm.on_policy_distill`
through the real CLI, on builtin:tiny-qwen3 (random init, a few steps).

Two domains, two teachers: `math` rows are scored by a teacher with the student's initial
weights and the student's prompt (so at step 1, before any update, its log-probs of the
sampled tokens must equal the student's exactly: this checks that the teacher scores the
sampled tokens at the right positions), and `calc` rows by the student's initial weights shown
the reference answer (privileged context: a non-zero signal from step 1, which moves the
student, after which the frozen math teacher disagrees with it too). A run killed in its
step-2 checkpoint save and resumed ends with the same bytes as the uninterrupted run.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def make_recipe(tmp_path: Path) -> Path:
    lines = (ROOT / "data/tiny-arith/train.jsonl").read_text().splitlines()[:32]
    data = []
    for i, line in enumerate(lines):
        row = json.loads(line)
        row["domain"] = "math" if i % 2 else "calc"
        data.append(json.dumps(row))
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(data) + "\n")
    recipe = {
        "pipeline": "rlvr",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {"train": {"path": str(train)}, "max_prompt_length": 64},
        "rollout": {
            "n": 1,  # pure distillation needs no groups
            "prompts_per_step": 8,
            "max_new_tokens": 4,
            "deterministic": True,
            "chunk_size": 8,
        },
        "algorithm": {
            "preset": "grpo",
            "kl": {"coef": 0.0},
            "on_policy_distill": {
                "teachers": {
                    "math": {"path": "builtin:tiny-qwen3"},
                    "calc": {"context_key": "answer"},  # the student's weights + the answer
                },
            },
        },
        "reward": {"domains": {"math": "math", "calc": "math"}},
        "trainer": {"max_steps": 3, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-2}},
        "actor_infer": {"num_threads": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 2},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "opd.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_teachers_score_the_sampled_tokens_and_resume_is_bitwise(roll, tmp_path) -> None:
    recipe = make_recipe(tmp_path)
    res = roll("train", "rlvr", str(recipe), "--run-id", "opd-base")
    assert res.returncode == 0, res.stderr
    logged = {r["step"]: r for r in rows(tmp_path / "runs" / "opd-base")}
    first, later = logged[1], logged[3]
    # math: identical weights, identical prompt -> identical log-probs of the sampled tokens
    assert first["distill/teacher_math/reverse_kl"] == 0.0
    # calc: the answer in the teacher's prompt changes its log-probs of the same tokens
    assert first["distill/teacher_calc/reverse_kl"] != 0.0
    assert first["distill/kl_advantage_abs_max"] > 0
    # pure distillation: the advantage is the teachers' signal alone
    assert first["actor/advantage_abs_max"] == pytest.approx(first["distill/kl_advantage_abs_max"])
    # the student moved; the frozen math teacher now disagrees with it
    assert later["distill/teacher_math/reverse_kl"] != 0.0
    assert {"time/teacher", "distill/teacher_log_prob", "distill/reverse_kl"} <= set(first)
    # the rollout record (roll view) holds the teacher's log-probs; the math teacher is the
    # student's starting weights, so at step 1 they equal the trainer's
    record = (tmp_path / "runs/opd-base/rollouts/step-000001.jsonl").read_text().splitlines()
    recorded = [json.loads(x) for x in record[1:]]
    assert len(recorded) == 8 and all(r["teacher_lp"] is not None for r in recorded)
    math_row = next(r for r in recorded if r["env"] == "math")
    assert math_row["teacher_lp"] == math_row["trainer_lp"]

    res = roll(
        "train", "rlvr", str(recipe), "--run-id", "opd-kill", env={"ROLL_DEBUG_KILL_IN_SAVE": "2"}
    )
    assert res.returncode == -signal.SIGKILL
    res = roll("resume", "opd-kill", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    a = load_file(str(tmp_path / "runs" / "opd-base" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "runs" / "opd-kill" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed = {r["step"]: r for r in rows(tmp_path / "runs" / "opd-kill")}
    assert resumed[3]["distill/reverse_kl"] == logged[3]["distill/reverse_kl"]


def test_full_mode_adds_the_exact_reverse_kl_to_the_loss(roll, tmp_path) -> None:
    """mode full (GKD's per-position reverse KL of the whole distributions): the math teacher
    is the student's own weights, so at step 1 its part is 0; the calc teacher (the answer in
    its prompt) is not, its gradient moves the student (no advantage carries any signal), and
    the frozen math teacher then disagrees too."""
    recipe = yaml.safe_load(make_recipe(tmp_path).read_text())
    recipe["algorithm"]["on_policy_distill"]["mode"] = "full"
    recipe["trainer"]["max_steps"] = 2
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    res = roll("train", "rlvr", str(path), "--run-id", "opd-full")
    assert res.returncode == 0, res.stderr
    logged = {r["step"]: r for r in rows(tmp_path / "runs" / "opd-full")}
    first, second = logged[1], logged[2]
    assert first["distill/teacher_math/reverse_kl"] == 0.0
    assert first["distill/full_divergence"] > 0  # the calc rows
    assert first["actor/distill_loss"] > 0
    assert first["actor/advantage_abs_max"] == 0.0  # the signal is in the loss, not here
    assert second["distill/teacher_math/reverse_kl"] != 0.0
