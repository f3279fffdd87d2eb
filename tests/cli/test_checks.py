"""`roll validate` checks: model names and paths, env names, context, resume overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from roll_cli.checks import check_recipe, context_warnings, resume_warnings, staleness_warnings
from roll_core.config import load_recipe
from roll_core.config.loader import dump_config
from roll_core.errors import ConfigError, ModelError

ROOT = Path(__file__).resolve().parents[2]


def recipe(tmp_path: Path, name: str, *overrides: str):
    return load_recipe(ROOT / "recipes" / name, list(overrides))


def test_unknown_builtin_is_an_error_and_a_missing_dir_a_warning(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"model\.path: unknown built-in model 'builtin:nope'"):
        check_recipe(recipe(tmp_path, "tiny-arith-sft.yaml", "model.path=builtin:nope"))
    missing = str(tmp_path / "not-yet")
    warnings = check_recipe(recipe(tmp_path, "tiny-arith-sft.yaml", f"model.path={missing}"))
    assert warnings == [
        f"model.path: model path not found: {missing} (resolved to {missing}). "
        "A run needs it to exist."
    ]
    (tmp_path / "empty").mkdir()  # exists but is no model: the run would fail, so do we
    with pytest.raises(ModelError, match="has no config.json"):
        check_recipe(recipe(tmp_path, "tiny-arith-sft.yaml", f"model.path={tmp_path}/empty"))


def test_teacher_path_is_checked_too(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"teacher\.path: unknown built-in model"):
        check_recipe(recipe(tmp_path, "tiny-distill.yaml", "teacher.path=builtin:nope"))


def test_env_names_are_built_as_the_run_builds_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown env 'sokobam'. Did you mean 'sokoban'"):
        check_recipe(recipe(tmp_path, "tiny-sokoban.yaml", "envs.0.env=sokobam"))
    assert check_recipe(recipe(tmp_path, "tiny-sokoban.yaml", "envs.0.eval_episodes=3")) == []


def test_context_warning(tmp_path: Path) -> None:
    cfg = recipe(tmp_path, "tiny-arith-sft.yaml", "data.max_length=600")
    # builtin:tiny-qwen3 has max_position_embeddings 512 < 600
    assert check_recipe(cfg) == [
        "data.max_length = 600 exceeds the model's context (512 tokens, "
        "max_position_embeddings): positions past it were never trained."
    ]
    rl = recipe(tmp_path, "tiny-arith-rlvr.yaml", "model.path=builtin:tiny-qwen3")
    assert context_warnings(rl, 70) == [  # 64 prompt + 8 new tokens = 72 > 70
        "data.max_prompt_length + rollout.max_new_tokens = 72 exceeds the model's context "
        "(70 tokens, max_position_embeddings): positions past it were never trained."
    ]
    assert context_warnings(rl, 72) == [] and context_warnings(rl, None) == []


def test_resume_warns_only_for_overrides_that_change_batches(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"seed": 0, "trainer": {"max_steps": 10, "micro_batch_size": 8}})
    )
    assert resume_warnings(config, ["trainer.max_steps=20", "trainer.micro_batch_size=8"]) == []
    (warning,) = resume_warnings(config, ["trainer.micro_batch_size=4", "trainer.max_steps=20"])
    assert warning.startswith("trainer.micro_batch_size changes from 8 to 4: the resumed steps")


def test_a_gpu_its_role_overflows_alone_is_a_warning(tmp_path: Path) -> None:
    """Disaggregated qwen2.5-7b-rlvr, FSDP2 over GPUs 4-7: 16 rows x (1024 + 3072) positions
    of Qwen2.5's 152,064 logits computed whole are 88.2 GiB on their own (issue 32 item 7);
    with the 4 rows the recipe sets they fit, and chunked (the default) at any row count."""
    from roll_cli.checks import memory_warnings
    from roll_core.engine.plan import make_plan

    whole = "actor_train.logit_chunk_tokens=0"  # the micro-batch's logits at once
    (warning,) = memory_warnings(
        make_plan(recipe(tmp_path, "qwen2.5-7b-rlvr.yaml", "trainer.micro_batch_size=16", whole))
    )
    assert warning.startswith(
        "GPUs 4-7: actor_train alone needs about 128.8 GiB at its peak (the memory rows of the "
        "plan), more than executor.gpu_memory_gib=80"
    )
    assert "lower trainer.micro_batch_size" in warning
    assert memory_warnings(make_plan(recipe(tmp_path, "qwen2.5-7b-rlvr.yaml"))) == []
    chunked = recipe(tmp_path, "qwen2.5-7b-rlvr.yaml", "trainer.micro_batch_size=16")
    assert memory_warnings(make_plan(chunked)) == []
    assert memory_warnings(make_plan(recipe(tmp_path, "tiny-arith-rlvr.yaml"))) == []  # no GPU plan


@pytest.mark.parametrize(
    ("overrides", "warns", "is_level"),
    [
        ((), False, None),  # synchronous: nothing is stale, no correction added
        (("rollout.async_generation_ratio=1",), False, "token"),  # the async default
        (("rollout.async_generation_ratio=1", "algorithm.rollout_correction=null"), True, None),
        (
            ("rollout.async_generation_ratio=1", "algorithm.rollout_correction.preset=seq_tis"),
            False,
            "sequence",
        ),
        (("rollout.async_generation_ratio=2", "algorithm.tis_cap=3.0"), False, "token"),
        (("rollout.async_generation_ratio=1", "algorithm.policy_loss=decoupled_ppo"), False, None),
    ],
)
@pytest.mark.parametrize("name", ["tiny-frozenlake.yaml", "tiny-arith-rlvr.yaml"])
def test_async_recipes_get_a_behaviour_correction_unless_turned_off(
    tmp_path: Path, name: str, overrides: tuple[str, ...], warns: bool, is_level: str | None
) -> None:
    cfg = recipe(tmp_path, name, *overrides)
    rc = cfg.algorithm.rollout_correction
    assert (rc.is_level if rc is not None else None) == is_level
    if overrides == ("rollout.async_generation_ratio=1",):
        assert rc.is_cap == 2.0 and rc.rs_level is None and rc.rs_divergence == []
    if "algorithm.tis_cap=3.0" in overrides:
        assert rc.is_cap == 3.0  # the recipe's cap, not the default's
    found = staleness_warnings(cfg)
    assert bool(found) == warns, found
    if warns:
        assert "algorithm.rollout_correction: null" in found[0]
        assert "{preset: token_tis}" in found[0]
    # the resolved config.yaml (what `roll resume` validates) means the same thing again
    again = type(cfg).model_validate(yaml.safe_load(dump_config(cfg)))
    assert again.algorithm.rollout_correction == rc
