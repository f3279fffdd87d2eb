"""`roll train agentic` with image observations on the tiny VLM, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-vl-frozenlake.yaml"


def test_tiny_vl_frozenlake_trains_two_steps(roll, tmp_path: Path) -> None:
    res = roll(
        "train",
        "agentic",
        str(RECIPE),
        f"runs_dir={tmp_path / 'runs'}",
        "envs.0.groups_per_step=2",
        "envs.0.eval_episodes=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "warm_start.steps=1",
        "warm_start.episodes_per_step=2",
        "trainer.max_steps=2",
        "trainer.micro_batch_size=8",
        "eval.every_steps=2",
        "checkpoint.every_steps=2",
        "actor_train.num_threads=1",
        "actor_infer.num_threads=1",
        "tracking.backends=[jsonl]",
        "--run-id",
        "vl",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    run = tmp_path / "runs" / "vl"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    # step mode: one row per turn; the trainer's log-probs on the rows (ids + images) are the
    # generation's, so the images trained are the images generated from
    assert steps[0]["perf/samples"] >= 4
    assert steps[0]["train_infer/logprob_diff"] < 1e-3
    assert "eval/success_rate" in steps[1] and "warm_start/loss_last" in rows[0]
    assert (run / "checkpoints" / "step-000002").is_dir()


def test_image_env_with_a_text_model_is_a_recipe_error(roll) -> None:
    res = roll("train", "agentic", str(RECIPE), "model.path=builtin:tiny-qwen3", "--dry-run")
    assert res.returncode == 2, res.stderr + res.stdout
    assert "envs[0] (frozen_lake) sets options.obs_mode=image" in res.stderr
    assert "model.path=builtin:tiny-qwen3 is a text-only model" in res.stderr
    assert "Traceback" not in res.stderr


def test_real_scale_vl_recipes_plan_the_vision_tower() -> None:
    """What `--dry-run` prints for the real-scale recipes (in-process: no CLI start-up)."""
    from roll_core.config import load_recipe
    from roll_core.pipelines import plan

    for name in ("qwen2.5-vl-3b-sokoban", "qwen2.5-vl-7b-distill"):
        rows = plan(load_recipe(ROOT / "recipes" / f"{name}.yaml", []))
        notes = " ".join(r.detail for r in rows if r.role == "memory/GPU")
        assert "3.75B params (0.67B of them the vision tower)" in notes, name
        # the agentic recipe also counts one micro-batch's logits: 2 rows x 4096 positions,
        # Qwen's 151,936 tokens, the output layer chunked (110 positions at a time, bf16: 22 x
        # 110 x V = 0.3 GiB); and the layer inputs gradient checkpointing keeps: 36 x 8192 x
        # 2048 x 2 = 1.1 GiB
        state = "params 7.0, grads 7.0, optim 42.0"
        train = f"55.9 GiB ({state})" if name.endswith("distill") else f"57.4 GiB ({state}, "
        assert f"actor_train {train}" in notes, name
        if name.endswith("distill"):  # the teacher's weights beside the student (8.29e9 x 2 B)
            (teacher,) = [r.detail for r in rows if r.role == "teacher"]
            assert "(8.29B params, 676.6M vision tower; weights 15.4 GiB in bfloat16)" in teacher


def test_user_env_with_pictures_and_a_text_model_is_refused(roll, tmp_path: Path) -> None:
    (tmp_path / "pic_env.py").write_text(
        "from PIL import Image\n"
        "from roll_core.envs import TextEnv, Transition\n\n"
        "class PicEnv(TextEnv):\n"
        "    def on_reset(self, rng):\n"
        "        return 'Look.', {}\n"
        "    def parse_action(self, text):\n"
        "        return text\n"
        "    def on_step(self, action):\n"
        "        return Transition('Done.', 1.0, True)\n"
        "    def render(self):\n"
        "        return 'a picture'\n"
        "    def render_image(self):\n"
        "        return Image.new('RGB', (28, 28))\n"
    )
    recipe = tmp_path / "pic.yaml"
    recipe.write_text(
        "pipeline: agentic\n"
        f"runs_dir: {tmp_path / 'runs'}\n"
        "model: {path: builtin:tiny-qwen3}\n"
        "envs: [{env: 'pic_env:PicEnv', groups_per_step: 1}]\n"
        "rollout: {group_size: 2}\n"
        "trainer: {max_steps: 1}\n"
    )
    res = roll("train", "agentic", str(recipe), cwd=tmp_path)
    assert res.returncode == 2, res.stderr + res.stdout
    assert "envs[0] (picenv) shows pictures" in res.stderr
    assert "model.path=builtin:tiny-qwen3 is a text-only model" in res.stderr
    assert not (tmp_path / "runs").exists()
