"""Recipe loading: overrides, typo suggestions, YAML errors, wrong types."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.config import apply_overrides, load_recipe
from roll_core.config.schema import SFTConfig
from roll_core.errors import ConfigError, UsageError

MINIMAL = """\
pipeline: sft
model: {path: builtin:tiny-qwen3}
data: {train: {path: data/tiny-arith/train.jsonl}}
trainer: {max_steps: 5}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_minimal_recipe_fills_defaults(tmp_path: Path) -> None:
    cfg = load_recipe(write(tmp_path, MINIMAL), expected="sft")
    assert isinstance(cfg, SFTConfig)
    assert cfg.trainer.max_steps == 5
    assert cfg.actor_train.optim.scheduler == "cosine"
    assert cfg.executor.type == "local"


def test_overrides_parse_values_as_yaml() -> None:
    data: dict = {"trainer": {"max_steps": 5}}
    apply_overrides(
        data, ["trainer.max_steps=10", "actor_train.optim.lr=1e-4", "eval.max_samples=null"]
    )
    assert data["trainer"]["max_steps"] == 10
    assert data["actor_train"]["optim"]["lr"] == "1e-4"  # YAML 1.1 string; pydantic coerces
    assert data["eval"]["max_samples"] is None


def test_override_applied_before_validation(tmp_path: Path) -> None:
    cfg = load_recipe(
        write(tmp_path, MINIMAL), ["actor_train.optim.lr=1e-4", "trainer.max_steps=7"]
    )
    assert cfg.actor_train.optim.lr == pytest.approx(1e-4)
    assert cfg.trainer.max_steps == 7


@pytest.mark.parametrize("bad", ["trainer.max_steps", "=3", "a..b=1"])
def test_malformed_override(bad: str) -> None:
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides({}, [bad])


def test_unknown_key_suggests_closest(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL.replace("max_steps: 5", "max_step: 5"))
    with pytest.raises(ConfigError) as exc:
        load_recipe(p)
    msg = exc.value.message
    assert str(p) in msg
    assert "trainer.max_step: unknown key; did you mean trainer.max_steps?" in msg


def test_unknown_nested_key_in_override(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"actor_train\.optim\.lrr: unknown key; did you mean actor_train\.optim\.lr\?",
    ):
        load_recipe(write(tmp_path, MINIMAL), ["actor_train.optim.lrr=0.1"])


def test_wrong_type_names_key_and_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_recipe(write(tmp_path, MINIMAL.replace("max_steps: 5", "max_steps: five")))
    assert "trainer.max_steps" in exc.value.message
    assert "integer" in exc.value.message and "'five'" in exc.value.message
    assert exc.value.exit_code == 2


def test_missing_required_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model: required key is missing"):
        load_recipe(write(tmp_path, MINIMAL.replace("model: {path: builtin:tiny-qwen3}\n", "")))


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL + "eval: [unclosed\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error at line \d+, column \d+"):
        load_recipe(p)


def test_missing_file_is_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_wrong_pipeline_for_command(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown pipeline 'sfft'. Did you mean sft"):
        load_recipe(write(tmp_path, MINIMAL.replace("pipeline: sft", "pipeline: sfft")))


def test_eval_schedule_requires_eval_data(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.eval"):
        load_recipe(write(tmp_path, MINIMAL), ["eval.every_steps=5"])


def test_several_problems_listed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="2 problems") as exc:
        load_recipe(write(tmp_path, MINIMAL), ["trainer.max_steps=0", "seed=x"])
    assert "trainer.max_steps" in exc.value.message and "seed" in exc.value.message


def test_unknown_tracker_rejected_at_validation(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"tracking\.backends\.1: .*'tensorboard'.*got 'tensorbord'"
    ):
        load_recipe(write(tmp_path, MINIMAL), ["tracking.backends=[console,tensorbord]"])


def test_cross_field_error_reads_plainly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_recipe(write(tmp_path, MINIMAL), ["eval.exact_match=true"])
    assert exc.value.message == (
        f"{tmp_path / 'r.yaml'}: eval.exact_match is true but data.eval is not set: add data.eval.path"
    )


def test_recipe_for_another_pipeline(tmp_path: Path) -> None:
    # a recipe written for a different (existing) pipeline names the command that runs it
    with pytest.raises(ConfigError, match="this recipe is for `rlvr`, not `sft`") as exc:
        load_recipe(
            write(tmp_path, MINIMAL.replace("pipeline: sft", "pipeline: rlvr")), expected="sft"
        )
    assert "roll rlvr" not in str(exc.value) or "roll train rlvr" in str(exc.value)


def test_unknown_pipeline_is_not_suggested_as_a_command(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown pipeline 'ppo'") as exc:
        load_recipe(
            write(tmp_path, MINIMAL.replace("pipeline: sft", "pipeline: ppo")), expected="sft"
        )
    assert "roll ppo" not in str(exc.value)


def test_typo_under_a_mapping_key_is_suggested(tmp_path: Path) -> None:
    # reward.domains is a mapping of domain name -> section: the name is stepped over
    p = tmp_path / "rl.yaml"
    p.write_text(
        "pipeline: rlvr\nmodel: {path: builtin:tiny-qwen3}\n"
        "data: {train: {path: x.jsonl}}\ntrainer: {max_steps: 2}\n"
        "reward: {domains: {math: {rewardz: [math]}}}\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"reward\.domains\.math\.rewardz: unknown key; did you mean reward\.domains\.math\.rewards\?",
    ):
        load_recipe(p)


def test_override_indexes_list_items() -> None:
    data: dict = {"envs": [{"name": "sokoban", "eval_episodes": 4}, {"name": "frozen_lake"}]}
    apply_overrides(data, ["envs.0.eval_episodes=16", "envs.1.max_turns=3", "tags.x=1"])
    assert data["envs"][0] == {"name": "sokoban", "eval_episodes": 16}
    assert data["envs"][1] == {"name": "frozen_lake", "max_turns": 3}
    data = {"rollout": {"stop": ["a", "b"]}}
    apply_overrides(data, ["rollout.stop.1=c"])
    assert data["rollout"]["stop"] == ["a", "c"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "envs.2.eval_episodes=1",
            r"envs has 2 item\(s\), so index 2 does not exist \(valid: 0 to 1\)",
        ),
        ("envs.first.eval_episodes=1", r"envs is a list, so the next part must be an index"),
        ("envs.0.name.x=1", r"envs\.0\.name is a value, not a section"),
    ],
)
def test_bad_list_override_is_a_clear_error(override: str, message: str) -> None:
    data: dict = {"envs": [{"name": "sokoban"}, {"name": "frozen_lake"}]}
    with pytest.raises(ConfigError, match=message):
        apply_overrides(data, [override])


def test_duplicate_keys_and_sections_name_both_lines(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"key trainer.max_steps is given twice \(line 2 and"):
        load_recipe(write(tmp_path, "trainer:\n  max_steps: 5\n  max_steps: 6\n"))
    text = "pipeline: sft\ntrainer: {max_steps: 5}\nmodel: {path: x}\ntrainer:\n  lr: 1\n"
    with pytest.raises(ConfigError, match=r"section trainer is given twice \(line 2 and line 4\)"):
        load_recipe(write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"key envs.1.name is given twice \(line 3 and line 4\)"):
        load_recipe(write(tmp_path, "envs:\n  - {name: a}\n  - name: b\n    name: c\n"))
    # the same key in two different sections is fine
    cfg = load_recipe(write(tmp_path, MINIMAL + "eval: {max_new_tokens: 5}\n"), expected="sft")
    assert cfg.eval.max_new_tokens == 5
