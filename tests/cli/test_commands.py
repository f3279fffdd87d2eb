"""The CLI surface: dry run, validate, models, schema, data, runs, version."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.data.arith import write_arith_dataset  # noqa: F401  (import check)

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_prints_plan_and_loads_nothing(
    roll, tiny_recipe, cache_dir: Path, tmp_path: Path
) -> None:
    before = sorted(cache_dir.rglob("*"))
    res = roll("sft", str(tiny_recipe()), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert (
        "resource plan" in res.stdout and "actor_train" in res.stdout and "ActorTrain" in res.stdout
    )
    assert "max_steps: 12" in res.stdout
    assert "recipe is valid" in res.stdout
    assert not (tmp_path / "runs").exists()
    assert sorted(cache_dir.rglob("*")) == before  # no model materialised or loaded


def test_validate_every_shipped_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """`roll validate` on every recipe in recipes/, in this process (the CLI's own command
    through typer's runner: one process instead of 27 that each import torch; the
    subprocess form is tested above)."""
    from typer.testing import CliRunner

    from roll_cli.main import app

    monkeypatch.chdir(ROOT)
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert len(recipes) > 20
    for recipe in recipes:
        res = CliRunner().invoke(app, ["validate", str(recipe)])
        if recipe.name in NEEDS_INSTALL and not (ROOT / NEEDS_INSTALL[recipe.name]).exists():
            # a harness installed apart from roll: its absence is the recipe's clear error
            assert res.exit_code != 0 and NEEDS_INSTALL[recipe.name] in res.output, res.output
            continue
        assert res.exit_code == 0, (recipe, res.output)
        assert "recipe is valid" in res.output, (recipe, res.output)


NEEDS_INSTALL = {
    "swe-mini-swe-agent-tiny.yaml": "mswe-venv/bin/python",
    "qwen3-4b-swe-mini-swe-agent.yaml": "mswe-venv/bin/python",
}
"""Recipes of harnesses installed in their own venv (docs/swe.md): the path they need."""


def test_models_lists_builtins(roll) -> None:
    res = roll("models")
    assert res.returncode == 0 and "builtin:tiny-qwen3" in res.stdout


def test_schema_matches_docs(roll) -> None:
    res = roll("schema")
    assert res.returncode == 0
    assert res.stdout == (ROOT / "docs" / "config.md").read_text()


def test_data_arith_regenerates_shipped_files(roll, tmp_path: Path) -> None:
    res = roll("data", "arith", str(tmp_path / "arith"))
    assert res.returncode == 0, res.stderr
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "arith" / name).read_bytes() == (
            ROOT / "data/tiny-arith" / name
        ).read_bytes()


def test_runs_on_empty_dir(roll, tmp_path: Path) -> None:
    res = roll("runs", "--runs-dir", str(tmp_path))
    assert res.returncode == 0 and "no runs" in res.stdout


def test_version(roll) -> None:
    res = roll("--version")
    assert res.returncode == 0 and res.stdout.startswith("roll ")
