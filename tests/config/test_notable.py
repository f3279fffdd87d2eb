"""The defaults `roll validate` points out (roll_core/config/notable.py)."""

from __future__ import annotations

from pathlib import Path

from roll_core.config import load_recipe
from roll_core.config.notable import notable_defaults

ROOT = Path(__file__).resolve().parents[2]


def test_grpo_recipe_lists_betas_kl_and_eps() -> None:
    cfg = load_recipe(ROOT / "recipes/tiny-arith-rlvr.yaml", [])
    keys = {n.key: n for n in notable_defaults(cfg)}
    assert set(keys) == {"actor_train.optim.betas", "algorithm.kl.coef", "algorithm.adv_eps"}
    assert "2402.03300" in keys["algorithm.kl.coef"].source


def test_common_values_are_not_listed() -> None:
    overrides = [
        "actor_train.optim.betas=[0.9, 0.999]",
        "algorithm.kl.coef=0",
        "algorithm.adv_eps=1e-4",
    ]
    cfg = load_recipe(ROOT / "recipes/tiny-arith-rlvr.yaml", overrides)
    assert notable_defaults(cfg) == []


def test_async_correction_is_listed_only_where_roll_added_it() -> None:
    recipe = ROOT / "recipes/tiny-arith-rlvr.yaml"
    keys = {
        n.key for n in notable_defaults(load_recipe(recipe, ["rollout.async_generation_ratio=1"]))
    }
    assert "algorithm.rollout_correction" in keys
    chosen = ["rollout.async_generation_ratio=1", "algorithm.rollout_correction.preset=token_tis"]
    keys = {n.key for n in notable_defaults(load_recipe(recipe, chosen))}
    assert "algorithm.rollout_correction" not in keys  # the recipe chose it
    keys = {n.key for n in notable_defaults(load_recipe(recipe, []))}
    assert "algorithm.rollout_correction" not in keys  # sync: nothing added
