"""Output off a terminal (CI logs, `| tee`, `| cat`): the real CLI with stdout and stderr
piped and an 80-column $COLUMNS, which rich used to wrap and cut at. Every line a user
copies (run id, paths, plan rows) must come out whole, on one line."""

from __future__ import annotations

from pathlib import Path

NARROW = {"COLUMNS": "80"}
LONG_ID = "a-deliberately-long-run-id-that-is-wider-than-any-terminal-column-budget-0001"


def test_a_piped_run_prints_whole_lines(roll, tiny_recipe, tmp_path: Path) -> None:
    recipe = tiny_recipe(
        runs_dir=str(tmp_path / "a-long-parent-directory-name-to-push-paths-past-80-columns"),
        trainer={"max_steps": 2, "micro_batch_size": 8, "grad_accum_steps": 1},
        eval={"every_steps": None},
        checkpoint={"every_steps": 2, "keep_last": 1},
    )
    res = roll("sft", str(recipe), "--run-id", LONG_ID, env=NARROW)
    assert res.returncode == 0, res.stderr
    run_dir = tmp_path / "a-long-parent-directory-name-to-push-paths-past-80-columns" / LONG_ID
    out = res.stdout.splitlines()
    done = next(line for line in out if line.startswith(f"run {LONG_ID} finished: "))
    assert "eval/loss " in done and "train/loss " in done
    assert f"run directory: {run_dir}" in out
    err = res.stderr.splitlines()
    assert f"final model (Hugging Face format): {run_dir / 'final'}" in err
    assert any(line.startswith("train 2/2  elapsed ") for line in err), err
    assert "loading tokenizer and data ..." in err
    assert "Setting accelerator" not in res.stdout + res.stderr  # DeepSpeed's CPU warning
    assert "━" not in res.stderr  # no bar drawn into a pipe

    runs = roll("runs", "--runs-dir", str(run_dir.parent), env=NARROW)
    assert runs.returncode == 0, runs.stderr
    row = next(line for line in runs.stdout.splitlines() if line.startswith(LONG_ID))
    assert row.split()[1:5] == ["sft", str(recipe), "finished", "2/2"]
    assert "eval/loss " in row  # the key metric: eval first


def test_a_piped_dry_run_prints_the_plan_rows_whole(roll, tiny_recipe) -> None:
    res = roll("sft", str(tiny_recipe()), "--dry-run", env=NARROW)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "resource plan" in lines
    header = next(line for line in lines if line.startswith("role "))
    assert header.split() == [
        "role",
        "worker",
        "backend",
        "world_size",
        "device",
        "executor",
        "detail",
    ]
    row = next(line for line in lines if line.startswith("actor_train "))
    assert row.split()[:6] == ["actor_train", "ActorTrain", "torch", "1", "auto", "local"]
    assert row.endswith("  micro_batch 8 x accum 2 = global batch 16")  # the detail, uncut
    assert "model: name=builtin:tiny-qwen3, source=builtin," in res.stdout
    assert all(len(line) <= 1000 for line in lines)  # no padding to a huge width
    assert "\x1b[" not in res.stdout  # no colour codes in a pipe


def test_error_messages_are_printed_verbatim_and_a_stop_is_not_an_error(capsys) -> None:
    import typer

    from roll_cli.common import handle_errors
    from roll_core.errors import ConfigError, Interrupted

    @handle_errors
    def fails(error: Exception) -> None:
        raise error

    hint = "Run `pip install wandb` (or `pip install roll[wandb]`), or drop it [bold]."
    try:
        fails(ConfigError("tracking.backends: wandb is not installed.", hint=hint))
    except typer.Exit as exit_:
        assert exit_.exit_code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: tracking.backends: wandb is not installed.", hint]
    try:
        fails(Interrupted("run r stopped at step 3 (checkpoint saved).", hint="roll resume r"))
    except typer.Exit as exit_:
        assert exit_.exit_code == 130
    err = capsys.readouterr().err.splitlines()
    assert err == ["stopped: run r stopped at step 3 (checkpoint saved).", "roll resume r"]
