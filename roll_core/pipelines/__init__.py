"""Pipelines and the two entry points the CLI calls: `launch` (a new run) and `resume`.

Both wrap the pipeline's driver loop so the run's status is always right: `finished`,
`interrupted` (Ctrl-C / SIGTERM, resumable) or `failed` (with the error kept in meta.json).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.config.loader import dump_config, load_config, read_yaml
from roll_core.config.recipes import PIPELINES, Recipe
from roll_core.engine.plan import Plan, make_plan
from roll_core.engine.resource_plan import check_capacity
from roll_core.pipelines.common import DriverLoop, RolePlan, RunInterrupted
from roll_core.pipelines.roles import check_engine_support, check_vision_support
from roll_core.runs import Run
from roll_core.runs.failure import explain_failure
from roll_core.tracking.progress import phase
from roll_core.tracking.terminal import make_console


@dataclass(frozen=True)
class Pipeline:
    """A pipeline's three entry points: `plan` (dry run), `prepare` (checks and data, before
    a run directory exists) and `run` (the driver loop)."""

    plan: Callable[[Any, Plan], list[RolePlan]]
    prepare: Callable[[Any], Any]
    run: Callable[[Any, Any, DriverLoop], dict[str, float]]


def pipeline(name: str) -> Pipeline:
    """The entry points of pipeline `name`, imported on first use (a run imports only its
    own pipeline's module, not the others' rollout machinery)."""
    if name not in PIPELINES:  # the recipe schema's names: one module of this package each
        raise KeyError(name)
    module = importlib.import_module(f"roll_core.pipelines.{name}")
    return Pipeline(plan=module.plan, prepare=module.prepare, run=module.run)


@dataclass
class RunResult:
    run: Run
    metrics: dict[str, float]


def plan(cfg: Recipe) -> list[RolePlan]:
    """The `--dry-run` table of a validated recipe: its plan, made once, as rows."""
    return plan_rows(cfg, make_plan(cfg))


def plan_rows(cfg: Recipe, plan: Plan) -> list[RolePlan]:
    """The `--dry-run` table of a validated recipe and its plan (`make_plan`; loads no
    model): the pipeline's roles, then for GPU recipes the placement per node and the memory
    estimate per GPU (roll_core/engine/placement.py). A recipe the executor cannot place, or
    a model or engine the roles cannot run, raises ConfigError."""
    rows = checked_rows(cfg, plan)
    return rows + gpu_plan_rows(cfg, plan)


def checked_rows(cfg: Recipe, plan: Plan) -> list[RolePlan]:
    """The pipeline's rows, after the checks every start makes before loading anything."""
    rows = pipeline(cfg.pipeline).plan(cfg, plan)
    check_vision_support(cfg)
    check_engine_support(cfg)
    check_capacity(cfg, rows)
    return rows


def gpu_plan_rows(cfg: Recipe, plan: Plan) -> list[RolePlan]:
    """Placement and memory as plan rows (none for a CPU recipe)."""
    from roll_core.engine.placement import span

    gp = plan.gpu
    if gp is None:
        return []
    ex = cfg.executor.type
    p = gp.placement
    rows = []
    for node, line in enumerate(p.node_lines()):
        head, _, detail = line.partition(": ")
        gpus = [g for g in range(p.num_gpus) if g // p.gpus_per_node == node]
        ids = head[head.index("(") + 1 : -1]
        rows.append(RolePlan(f"node {node}", "placement", "", len(gpus), ids, ex, detail))
    rows.append(RolePlan("placement", "", "", p.num_gpus, "cuda", ex, gp.colocation()))
    for gpus, text in gp.memory_groups():
        where = f"GPUs {span(gpus)}"
        rows.append(RolePlan("memory/GPU", "estimate", "", len(gpus), where, ex, text))
    rows.append(RolePlan("memory/GPU", "model", "", p.num_gpus, "", ex, gp.model_note))
    if plan.offload is not None:
        rows += phase_rows(cfg, plan)
    return rows


def phase_rows(cfg: Recipe, plan: Plan) -> list[RolePlan]:
    """Colocated GPUs: the estimated peak of each phase with the resolved offload."""
    from roll_core.engine.colocation import PHASES
    from roll_core.engine.placement import span

    choice = plan.rl()[0]
    groups: dict[str, list[int]] = {}
    for gpu, peaks in choice.peaks.items():
        text = ", ".join(f"{ph} {peaks[ph] / 1024**3:.1f} GiB" for ph in PHASES)
        text += f" (of {cfg.executor.gpu_memory_gib:g} GiB)"
        groups.setdefault(text, []).append(gpu)
    ex = cfg.executor.type
    return [
        RolePlan("memory/phase", "estimate", "", len(g), f"GPUs {span(g)}", ex, text)
        for text, g in groups.items()
    ]


def _execute(
    cfg: Recipe,
    setup: Any,
    run: Run,
    *,
    plan: Plan,
    resume: bool,
    new_config: str | None = None,
) -> RunResult:
    loop = DriverLoop(cfg, run, plan=plan, resume=resume, new_config=new_config)
    try:
        metrics = pipeline(cfg.pipeline).run(cfg, setup, loop)
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        loop.close("interrupted")
        raise RunInterrupted(
            f"run {run.id} interrupted; it resumes from its last checkpoint "
            "(from step 0 if none was saved yet).",
            hint=f"Continue it with: {loop.resume_command()}",
        ) from None
    except BaseException as err:
        if resume and not loop.started:  # a refused resume leaves the run as it was
            loop.close(None)
            raise
        problems = loop.close_failed(err)
        clear = explain_failure(
            err,
            run_dir=run.dir,
            last_checkpoint=loop.last_checkpoint(),
            resume_command=loop.resume_command(),
            problems=problems,
        )
        if clear is not None:
            raise clear from err
        raise
    return RunResult(run=run, metrics=metrics)


def _prepare(cfg: Recipe) -> Any:
    """The pipeline's `prepare` (tokenizer, data, checks), shown as a phase on the console."""
    with phase(make_console(stderr=True), "loading tokenizer and data"):
        return pipeline(cfg.pipeline).prepare(cfg)


def launch(
    cfg: Recipe, *, recipe: str | None, run_id: str | None = None, plan: Plan | None = None
) -> RunResult:
    """Create a run directory for `cfg` and run its pipeline. `plan`: the recipe's
    `make_plan` when the caller made it already (the CLI, which checks it first); a launch
    computes it once and every role, turn and sync reads it from there."""
    plan = make_plan(cfg) if plan is None else plan
    checked_rows(cfg, plan)
    setup = _prepare(cfg)
    run = Run.create(
        cfg.runs_dir,
        config_yaml=dump_config(cfg),
        name=cfg.name or cfg.pipeline,
        pipeline=cfg.pipeline,
        command=sys.argv,
        recipe=recipe,
        run_id=run_id,
    )
    return _execute(cfg, setup, run, plan=plan, resume=False)


def load_run_config(run: Run, overrides: list[str]) -> Recipe:
    """The run's resolved config.yaml with `overrides` applied, validated again by the
    function that validated the recipe at start (so what started resumes)."""
    return load_config(read_yaml(run.config_path), overrides, source=str(run.config_path))


def resume(run_id: str, *, runs_dir: str | Path, overrides: list[str] | None = None) -> RunResult:
    """Continue run `run_id` in its own directory from its newest intact checkpoint.

    Overrides (e.g. a larger trainer.max_steps) are written into the run's config.yaml once
    the checkpoint has loaded; a refused resume leaves the run directory as it was.
    """
    run = Run.open(runs_dir, run_id)
    cfg = load_run_config(run, list(overrides or []))
    plan = make_plan(cfg)
    checked_rows(cfg, plan)
    setup = _prepare(cfg)
    new_config = dump_config(cfg) if overrides else None
    return _execute(cfg, setup, run, plan=plan, resume=True, new_config=new_config)


__all__ = [
    "PIPELINES",
    "Pipeline",
    "pipeline",
    "RolePlan",
    "RunInterrupted",
    "RunResult",
    "launch",
    "plan",
    "resume",
]
