"""The `roll` command. Each command parses its arguments, loads the recipe, calls one
roll_core entry point and turns known errors into a message and an exit code."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from roll_cli.checks import check_recipe, resume_warnings
from roll_cli.common import (
    Debug,
    DryRun,
    Overrides,
    Recipe,
    RunId,
    RunsDir,
    _say,
    err,
    handle_errors,
    out,
)
from roll_cli.convert import convert_app
from roll_cli.debug_env import debug_env
from roll_cli.evaluate import eval_command, generate_command
from roll_cli.report import report_command
from roll_cli.serve import serve_command
from roll_cli.view import view_command
from roll_core import __version__
from roll_core.errors import RollError
from roll_core.tracking.terminal import print_table

app = typer.Typer(
    name="roll",
    help="RL post-training of LLMs: strict recipes, exact resume, local debug, Ray scale-out.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    add_completion=False,
)
data_app = typer.Typer(help="Make the small datasets the tiny recipes use.", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(convert_app, name="convert")
train_app = typer.Typer(
    help="Reinforcement learning: `roll train rlvr RECIPE` (verifiable rewards: GRPO, DAPO, "
    "PPO) and `roll train agentic RECIPE` (multi-turn text environments).",
    no_args_is_help=True,
)
app.add_typer(train_app, name="train")


def _print_plan(cfg: Any) -> None:
    from rich.syntax import Syntax

    from roll_core.config import dump_config
    from roll_core.engine.plan import make_plan
    from roll_core.pipelines import plan_rows
    from roll_core.tracking.terminal import is_live

    the_plan = make_plan(cfg)
    warnings = check_recipe(cfg, the_plan)  # an error a run would hit stops here, before output
    if is_live(out):
        out.print(Syntax(dump_config(cfg), "yaml", theme="ansi_dark", background_color="default"))
    else:
        out.print(dump_config(cfg).rstrip("\n"), markup=False, highlight=False)
    columns = ("role", "worker", "backend", "world_size", "device", "executor", "detail")
    rows = [
        (r.role, r.worker, r.backend, str(r.world_size), r.device, r.executor, r.detail)
        for r in plan_rows(cfg, the_plan)
    ]
    print_table(out, "resource plan", columns, rows)
    _print_notable_defaults(cfg)
    _print_model_summary(cfg, warnings)
    out.print("[green]recipe is valid[/green] (dry run: no model loaded, nothing written)")


def _print_model_summary(cfg: Any, warnings: list[str]) -> None:
    """The model's size, then the warnings of `check_recipe` (see roll_cli/checks.py)."""
    from roll_core.models import model_summary

    for warning in warnings:
        _say("warning: ", warning, "yellow")
    try:
        summary = model_summary(cfg.model.path)
    except RollError:  # not there yet: warned about above
        return
    known = ", ".join(f"{k}={v}" for k, v in summary.items() if v is not None)
    unknown = [k for k, v in summary.items() if v is None]
    if unknown:  # a hub model not downloaded yet: its config.json is not here to read
        known += f" ({', '.join(unknown)}: unknown until the model is downloaded)"
    out.print("model: " + known, markup=False)


def _print_notable_defaults(cfg: Any) -> None:
    """The recipe's settings that differ from common defaults (roll_core/config/notable.py)."""
    from roll_core.config.notable import notable_defaults

    rows = [(r.key, r.value, r.common, r.source) for r in notable_defaults(cfg)]
    if rows:
        columns = ("key", "value", "common elsewhere", "why / source")
        print_table(out, "settings that differ from common defaults", columns, rows)


def _run_training(
    pipeline: str, recipe: Path, overrides: list[str] | None, dry_run: bool, run_id: str | None
) -> None:
    from roll_core.config import load_recipe

    # the recipe first: its errors come before the engine's imports (torch, datasets)
    cfg = load_recipe(recipe, overrides or [], expected=pipeline)
    from roll_core.engine.plan import make_plan
    from roll_core.pipelines import launch

    if dry_run:
        _print_plan(cfg)
        return
    plan = make_plan(cfg)  # once: the checks, then every role of the run, read it
    for warning in check_recipe(cfg, plan):
        _say("warning: ", warning, "yellow")
    result = launch(cfg, recipe=str(recipe), run_id=run_id, plan=plan)
    _report(result)


def _report(result: Any) -> None:
    from roll_core.tracking.console import format_metrics, summary_metrics

    shown = format_metrics(summary_metrics(result.metrics))
    _say(f"run {result.run.id} finished", f": {shown}" if shown else "", "green", console=out)
    _say("", f"run directory: {result.run.dir}", console=out)


@app.command()
@handle_errors
def sft(
    recipe: Recipe,
    overrides: Overrides = None,
    dry_run: DryRun = False,
    run_id: RunId = None,
    debug: Debug = False,
) -> None:
    """Supervised fine-tuning (loss on response tokens) from a recipe."""
    _run_training("sft", recipe, overrides, dry_run, run_id)


@app.command()
@handle_errors
def dpo(
    recipe: Recipe,
    overrides: Overrides = None,
    dry_run: DryRun = False,
    run_id: RunId = None,
    debug: Debug = False,
) -> None:
    """Preference optimisation (DPO, IPO, cDPO) on chosen/rejected pairs from a recipe."""
    _run_training("dpo", recipe, overrides, dry_run, run_id)


@app.command()
@handle_errors
def distill(
    recipe: Recipe,
    overrides: Overrides = None,
    dry_run: DryRun = False,
    run_id: RunId = None,
    debug: Debug = False,
) -> None:
    """Distil a frozen teacher into a student (forward/reverse KL, JSD, skew KL) from a recipe."""
    _run_training("distill", recipe, overrides, dry_run, run_id)


@train_app.command("rlvr")
@handle_errors
def train_rlvr(
    recipe: Recipe,
    overrides: Overrides = None,
    dry_run: DryRun = False,
    run_id: RunId = None,
    debug: Debug = False,
) -> None:
    """RL with verifiable rewards (GRPO, DAPO, PPO-family presets) from a recipe."""
    _run_training("rlvr", recipe, overrides, dry_run, run_id)


@train_app.command("agentic")
@handle_errors
def train_agentic(
    recipe: Recipe,
    overrides: Overrides = None,
    dry_run: DryRun = False,
    run_id: RunId = None,
    debug: Debug = False,
) -> None:
    """Multi-turn agentic RL in text environments (StarPO trajectory-wise, GiGPO step-wise)."""
    _run_training("agentic", recipe, overrides, dry_run, run_id)


@app.command()
@handle_errors
def validate(recipe: Recipe, overrides: Overrides = None, debug: Debug = False) -> None:
    """Validate any recipe and print its resolved config and resource plan."""
    from roll_core.config import load_recipe

    _print_plan(load_recipe(recipe, overrides or []))


@app.command()
@handle_errors
def resume(
    run_id: Annotated[str, typer.Argument(help="Run id (see `roll runs`).", show_default=False)],
    overrides: Overrides = None,
    runs_dir: RunsDir = Path("runs"),
    debug: Debug = False,
) -> None:
    """Continue a run in its own directory from its newest intact checkpoint."""
    from roll_core.pipelines import resume as resume_run
    from roll_core.runs import Run

    if overrides:
        for warning in resume_warnings(Run.open(runs_dir, run_id).config_path, overrides):
            _say("warning: ", warning, "yellow")
    _report(resume_run(run_id, runs_dir=runs_dir, overrides=overrides or []))


@app.command()
@handle_errors
def runs(
    runs_dir: RunsDir = Path("runs"),
    limit: Annotated[int, typer.Option("--limit", "-n", help="Show at most N runs.")] = 20,
    debug: Debug = False,
) -> None:
    """List runs: id, recipe, status, step, key metric, age."""
    import time

    from roll_core.errors import RollError
    from roll_core.runs import list_runs
    from roll_core.tracking.console import key_metric

    rows = []
    for run in list_runs(runs_dir)[:limit]:
        try:
            meta = run.meta()
        except (RollError, OSError) as e:  # one damaged run must not hide the others
            rows.append((run.id, "?", "", "damaged", "?", "", ""))
            text = e.message if isinstance(e, RollError) else f"run {run.id}: {e}"
            err.print(f"[yellow]warning:[/yellow] {text}", highlight=False, soft_wrap=True)
            continue
        rows.append(
            (
                run.id,
                meta.get("pipeline", "?"),
                str(meta.get("recipe") or ""),
                meta.get("status", "?"),
                f"{meta.get('step', 0)}/{_max_steps(run)}",
                key_metric(meta.get("metrics") or {}),
                _age(time.time() - meta.get("created", time.time())),
            )
        )
    if not rows:
        out.print(f"no runs in {runs_dir}", markup=False)
    else:
        columns = ("id", "pipeline", "recipe", "status", "step", "key metric", "age")
        print_table(out, f"runs in {runs_dir}", columns, rows)


def _max_steps(run: Any) -> str:
    import yaml

    try:
        return str(yaml.safe_load(run.config_path.read_text())["trainer"]["max_steps"])
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return "?"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


@app.command()
@handle_errors
def models(debug: Debug = False) -> None:
    """List the built-in tiny models (use them as `model.path: builtin:NAME`)."""
    from roll_core.models import BUILTIN_MODELS, model_summary

    rows = []
    for name, spec in BUILTIN_MODELS.items():
        s = model_summary(f"builtin:{name}")
        rows.append(
            (
                f"builtin:{name}",
                f"{s.get('approx_params', 0):,}",
                str(s.get("num_layers")),
                str(s.get("hidden_size")),
                spec.description,
            )
        )
    columns = ("name", "params", "layers", "hidden", "description")
    print_table(out, "built-in models", columns, rows)


@app.command()
@handle_errors
def schema(debug: Debug = False) -> None:
    """Print the config reference (docs/config.md, Markdown) generated from the schema."""
    from roll_core.config.reference import config_reference

    sys.stdout.write(config_reference() + "\n")


app.command("debug-env")(debug_env)


app.command("eval")(eval_command)
app.command("generate")(generate_command)
app.command("report")(report_command)
app.command("view")(view_command)
app.command("serve")(serve_command)


@data_app.command("arith")
@handle_errors
def data_arith(
    out_dir: Annotated[Path, typer.Argument(help="Directory for train.jsonl and test.jsonl.")],
    n_train: Annotated[int, typer.Option(help="Training rows.")] = 20000,
    n_test: Annotated[int, typer.Option(help="Held-out rows (disjoint from train).")] = 500,
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
    debug: Debug = False,
) -> None:
    """Write the arithmetic dataset the tiny recipes use (deterministic for a seed)."""
    from roll_core.data.arith import write_arith_dataset

    write_arith_dataset(out_dir, n_train=n_train, n_test=n_test, seed=seed)
    out.print(
        f"wrote {out_dir}/train.jsonl ({n_train} rows) and {out_dir}/test.jsonl ({n_test} rows)"
    )


@data_app.command("arith-pairs")
@handle_errors
def data_arith_pairs(
    out_dir: Annotated[Path, typer.Argument(help="Directory for train.jsonl and test.jsonl.")],
    n_train: Annotated[int, typer.Option(help="Training pairs.")] = 5000,
    n_test: Annotated[int, typer.Option(help="Held-out pairs (disjoint from train).")] = 500,
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
    debug: Debug = False,
) -> None:
    """Write the arithmetic preference pairs of the tiny DPO recipe (right vs near-miss answer)."""
    from roll_core.data.preference import write_arith_pairs

    write_arith_pairs(out_dir, n_train=n_train, n_test=n_test, seed=seed)
    out.print(
        f"wrote {out_dir}/train.jsonl ({n_train} pairs) and {out_dir}/test.jsonl ({n_test} pairs)"
    )


@data_app.command("shapes")
@handle_errors
def data_shapes(
    out_dir: Annotated[
        Path, typer.Argument(help="Directory for train.jsonl, test.jsonl and images/.")
    ],
    n_train: Annotated[int, typer.Option(help="Training rows.")] = 1000,
    n_test: Annotated[int, typer.Option(help="Held-out rows (images disjoint from train).")] = 200,
    max_count: Annotated[int, typer.Option(help="Most squares in one image (1..4).")] = 4,
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
    debug: Debug = False,
) -> None:
    """Write the count-the-squares image dataset of the vision-language recipes (56x56 PNGs)."""
    from roll_core.data.shapes import write_shapes_dataset
    from roll_core.errors import ConfigError

    if not 1 <= max_count <= 4:
        raise ConfigError(
            f"--max-count must be between 1 and 4 (a 2x2 grid of cells), got {max_count}.",
            hint="Pass --max-count 4 (the default) or another value in 1..4.",
        )
    write_shapes_dataset(out_dir, n_train=n_train, n_test=n_test, seed=seed, max_count=max_count)
    out.print(
        f"wrote {out_dir}/train.jsonl ({n_train} rows), {out_dir}/test.jsonl ({n_test} rows) "
        f"and {n_train + n_test} images in {out_dir}/images/"
    )


@data_app.command("swe")
@handle_errors
def data_swe(
    out_dir: Annotated[
        Path, typer.Argument(help="New directory for train/, test/ and manifest.json.")
    ],
    count: Annotated[int, typer.Option(help="Tasks to write (train + held out).")] = 240,
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
    held_out: Annotated[
        float, typer.Option(help="Share of each repository's functions held out (test split).")
    ] = 0.2,
    repos: Annotated[
        str | None,
        typer.Option(help="Comma-separated repositories to use (default: all seven)."),
    ] = None,
    debug: Debug = False,
) -> None:
    """Generate SWE-style tasks (bugs planted in small Python repositories, each verified in
    the sandbox); see docs/swe.md."""
    from roll_core.errors import ConfigError
    from roll_core.swe.generate import generate_swe_tasks, pick_templates

    if count < 1 or not 0 < held_out < 1:
        raise ConfigError(
            f"--count must be at least 1 and --held-out between 0 and 1 (got {count}, {held_out}).",
            hint="For example: roll data swe OUT --count 240 --held-out 0.2",
        )
    templates = pick_templates(repos.split(",") if repos else None)
    report = generate_swe_tasks(
        out_dir, seed=seed, count=count, held_out=held_out, templates=templates
    )
    out.print(
        f"wrote {report.train} train and {report.test} held-out SWE tasks to {out_dir} "
        f"({report.candidates_tried} candidate bugs checked, {report.dropped} dropped)"
    )


@data_app.command("swe-check")
@handle_errors
def data_swe_check(
    tasks: Annotated[
        Path, typer.Argument(help="A task folder, a folder of them, or a SWE-bench-style JSONL.")
    ],
    debug: Debug = False,
) -> None:
    """Check SWE tasks in the sandbox: the fail-to-pass tests fail before the reference fix,
    every test passes after it (docs/swe.md)."""
    from roll_core.errors import DataError
    from roll_core.sandbox import LocalBackend
    from roll_core.swe.grading import check_tasks
    from roll_core.swe.task import load_tasks

    loaded = load_tasks(tasks)
    errors = check_tasks(loaded, backend=LocalBackend())
    if errors:
        shown = "\n".join(f"  {err.message}" for err in errors[:20])
        raise DataError(
            f"{len(errors)} of {len(loaded)} SWE tasks in {tasks} are not sound:\n{shown}",
            hint="Fix or remove those tasks (docs/swe.md, the task format).",
        )
    out.print(f"{len(loaded)} SWE tasks in {tasks} are sound")


def _version(value: bool) -> None:
    if value:
        out.print(f"roll {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """RL post-training of LLMs from one CLI."""


def main() -> None:
    from roll_core.tracking.quiet import quiet_third_party

    quiet_third_party(debug="--debug" in sys.argv[1:] or os.environ.get("ROLL_DEBUG") == "1")
    app()


if __name__ == "__main__":
    main()
