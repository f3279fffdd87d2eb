"""What a run accepts at start, `roll resume` accepts: a new run's config.yaml read back by
the resume path gives the same config, for every shipped recipe and every train backend (and
RL recipes with async generation, where roll adds a behaviour correction by default); a
recipe whose config.yaml would not read back is refused before its run directory exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from roll_core.config import loader
from roll_core.config.loader import dump_config, load_recipe
from roll_core.errors import ConfigError
from roll_core.pipelines import load_run_config
from roll_core.runs import Run

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
VARIANTS = [
    [],  # as shipped
    *([f"actor_train.backend={b}"] for b in ("torch", "fsdp2", "deepspeed")),
    # the other backends' sections go with their backend
    ["actor_train.backend=megatron", "actor_train.fsdp2=null", "actor_train.deepspeed=null"],
    ["rollout.async_generation_ratio=1"],  # RL: a behaviour correction roll adds by default
]


def _started(runs: Path, recipe: str, overrides: list[str]) -> tuple[object, Run] | None:
    """(the config, its run directory) as `launch` writes it, or None when start refuses."""
    try:
        cfg = load_recipe(ROOT / "recipes" / recipe, overrides)
    except ConfigError:  # start refuses it: nothing to resume (e.g. lora with fsdp2)
        return None
    run = Run.create(
        runs,
        config_yaml=dump_config(cfg),
        name="x",
        pipeline=cfg.pipeline,  # type: ignore[attr-defined]
        command=["roll"],
        recipe=recipe,
    )
    return cfg, run


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_resumes_the_config_it_started_with(recipe: str, tmp_path: Path) -> None:
    started = 0
    for overrides in VARIANTS:
        found = _started(tmp_path / "runs", recipe, overrides)
        if found is None:
            continue
        cfg, run = found
        again = load_run_config(run, [])  # what `roll resume` runs
        assert again.model_dump() == cfg.model_dump(), (recipe, overrides)
        assert run.config_path.read_text() == dump_config(again)  # written back unchanged
        started += 1
    assert started >= 2, recipe  # the recipe as shipped, and at least one other backend


def test_megatron_runs_resume_a_config_yaml_with_the_default_packing(tmp_path: Path) -> None:
    """The default `actor_train.packing: true` is what a megatron run's config.yaml records
    (and what an earlier roll wrote, then refused on resume); false is accepted too."""
    for packing in ("true", "false"):
        overrides = ["actor_train.backend=megatron", f"actor_train.packing={packing}"]
        found = _started(tmp_path / "runs", "tiny-arith-sft.yaml", overrides)
        assert found is not None
        cfg, run = found
        assert yaml.safe_load(run.config_path.read_text())["actor_train"]["packing"] is (
            packing == "true"
        )
        assert load_run_config(run, []).model_dump() == cfg.model_dump()


def test_a_config_that_would_not_resume_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resolved config.yaml the resume path would refuse (or read otherwise) is roll's bug:
    `roll validate` and a new run stop on it, before a run directory exists."""
    from typer.testing import CliRunner

    from roll_cli.main import app

    write = loader.dump_config
    recipe = ROOT / "recipes" / "tiny-arith-sft.yaml"
    runs = tmp_path / "runs"
    # a config.yaml that records a value its own schema refuses
    monkeypatch.setattr(loader, "dump_config", lambda cfg: write(cfg) + "trainer_x: 1\n")
    with pytest.raises(RuntimeError, match=r"unknown key.*a run that could not resume"):
        load_recipe(recipe, [])
    res = CliRunner().invoke(app, ["sft", str(recipe), f"runs_dir={runs}"])
    assert res.exit_code == 1, res.output
    assert "internal error" in res.output and "This is a bug in roll" in res.output
    assert not runs.exists()
    # one that validates but reads back as another value
    monkeypatch.setattr(
        loader, "dump_config", lambda cfg: write(cfg).replace("max_steps: 7", "max_steps: 8")
    )
    with pytest.raises(RuntimeError, match=r"reads back otherwise at trainer\.max_steps\)"):
        load_recipe(recipe, ["trainer.max_steps=7"])
