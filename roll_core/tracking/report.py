"""`roll report`: PNG plots of one or more runs' metrics.jsonl, overlaid per metric.

One figure per panel (reward / accuracy, loss, KL, entropy, response length, time split per
step); a panel no run has data for is skipped. Curves are the logged values against the step,
one line per (run, metric); the time split is a stacked area of the ``time/*`` phases, one
subplot per run. Beside the PNGs, ``report.json`` records every plotted series (the exact
x and y of each line), so what a figure shows can be checked without reading pixels.

matplotlib (Agg backend, no display needed) draws the figures: a well-kept library for a
job that is all edge cases (ticks, legends, layout) when written by hand.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.errors import UsageError
from roll_core.runs import Run, atomic_write_text
from roll_core.tracking.jsonl import read_metrics

Series = dict[str, list[float]]
"""``{"step": [...], "value": [...]}``."""


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    patterns: tuple[str, ...]
    """fnmatch patterns of metric keys, most specific first; all matches are plotted."""
    exclude: tuple[str, ...] = ()


PANELS: tuple[Panel, ...] = (
    Panel(
        "reward",
        "reward / accuracy",
        (
            "rollout/reward_mean",
            "rollout/success_rate",
            "rollout/episode_return",
            "eval/accuracy",
            "eval/exact_match",
            "eval/reward_mean",
            "eval/success_rate",
            "eval/ref_logp_accuracy",
            "eval/teacher_exact_match",
        ),
    ),
    Panel("loss", "loss", ("train/loss", "eval/loss", "actor/pg_loss", "critic/vf_loss")),
    Panel("kl", "KL", ("actor/*kl*",), exclude=("*coef*",)),
    Panel("entropy", "entropy", ("actor/entropy",)),
    Panel(
        "response_length",
        "response length (tokens)",
        ("rollout/response_length_mean", "eval/response_length_mean"),
    ),
)
TIME_PATTERN = "time/*"


@dataclass
class Report:
    out_dir: Path
    files: list[Path]
    data: dict[str, Any]
    """What report.json holds: the runs and each panel's file and series."""


def series_of(records: Sequence[dict[str, Any]], key: str) -> Series:
    """The (step, value) pairs of `key`, in step order; non-numbers and NaN are skipped, and a
    step logged twice keeps its last value (a resumed run re-logs nothing, but be safe)."""
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            continue
        by_step[int(record["step"])] = float(value)
    steps = sorted(by_step)
    return {"step": [float(s) for s in steps], "value": [by_step[s] for s in steps]}


def panel_keys(panel: Panel, keys: Sequence[str]) -> list[str]:
    """The metric keys `panel` plots, in pattern order."""
    chosen: list[str] = []
    for pattern in panel.patterns:
        for key in sorted(keys):
            excluded = any(fnmatch.fnmatchcase(key, x) for x in panel.exclude)
            if fnmatch.fnmatchcase(key, pattern) and key not in chosen and not excluded:
                chosen.append(key)
    return chosen


def _keys(records: Sequence[dict[str, Any]]) -> list[str]:
    return sorted({k for r in records for k in r if k not in ("step", "time")})


def write_report(runs: Sequence[Run], out_dir: Path) -> Report:
    """Plot `runs` (overlaid) into `out_dir`: one PNG per panel with data, and report.json."""
    records = {run.id: read_metrics(run.metrics_path) for run in runs}
    out_dir.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"runs": [r.id for r in runs], "panels": {}}
    files = []
    for panel in PANELS:
        plotted = {
            rid: {k: series_of(recs, k) for k in panel_keys(panel, _keys(recs))}
            for rid, recs in records.items()
        }
        plotted = {rid: s for rid, s in plotted.items() if any(v["step"] for v in s.values())}
        if not plotted:
            continue
        path = out_dir / f"{panel.name}.png"
        _save(line_figure(panel.title, plotted, several=len(runs) > 1), path)
        data["panels"][panel.name] = {"file": path.name, "series": plotted}
        files.append(path)
    times = {rid: _time_split(recs) for rid, recs in records.items()}
    times = {rid: s for rid, s in times.items() if s}
    if times:
        path = out_dir / "time.png"
        _save(time_figure(times), path)
        data["panels"]["time"] = {"file": path.name, "series": times}
        files.append(path)
    atomic_write_text(out_dir / "report.json", json.dumps(data, indent=1) + "\n")
    return Report(out_dir=out_dir, files=files, data=data)


def _time_split(records: Sequence[dict[str, Any]]) -> dict[str, Series]:
    keys = [k for k in _keys(records) if fnmatch.fnmatchcase(k, TIME_PATTERN)]
    return {k: s for k in keys if (s := series_of(records, k))["step"]}


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only; no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    plt = _pyplot()

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def line_figure(title: str, plotted: dict[str, dict[str, Series]], *, several: bool) -> Any:
    """An 800x450 px figure: one line per (run, key) of `plotted` against the step."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for rid, by_key in plotted.items():
        for key, s in by_key.items():
            label = f"{rid}: {key}" if several else key
            marker = "o" if len(s["step"]) <= 20 else None
            ax.plot(s["step"], s["value"], label=label, marker=marker, markersize=3)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def time_figure(times: dict[str, dict[str, Series]]) -> Any:
    """Stacked seconds per phase against the step; one subplot per run (steps where a phase
    was not logged count 0 for it)."""
    plt = _pyplot()

    fig, axes = plt.subplots(
        len(times), 1, figsize=(8, 3.5 * len(times)), dpi=100, squeeze=False, sharex=True
    )
    for ax, (rid, by_key) in zip(axes[:, 0], times.items(), strict=True):
        steps = sorted({s for series in by_key.values() for s in series["step"]})
        stacks = []
        for series in by_key.values():
            value = dict(zip(series["step"], series["value"], strict=True))
            stacks.append([value.get(s, 0.0) for s in steps])
        ax.stackplot(steps, *stacks, labels=[k.removeprefix("time/") for k in by_key])
        ax.set_title(f"time split per step (s): {rid}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("step")
    return fig


def report_runs(
    run_ids: Sequence[str], *, runs_dir: str | Path = "runs", out_dir: Path | None = None
) -> Report:
    """`roll report`: plot the named runs into `out_dir` (default: the first run's
    ``report/``, or ``report-compare/`` when several runs are overlaid).

    Raises:
        UsageError: an unknown run id, or runs that have logged nothing yet.
    """
    ids = list(dict.fromkeys(run_ids))
    if not ids:
        raise UsageError("name at least one run id (`roll runs` lists them).")
    runs = [Run.open(runs_dir, rid) for rid in ids]
    empty = [r.id for r in runs if not read_metrics(r.metrics_path)]
    if len(empty) == len(runs):
        raise UsageError(
            f"nothing to plot: {', '.join(empty)} logged no metrics yet (metrics.jsonl is "
            "empty or missing).",
            hint="A run writes metrics.jsonl when `jsonl` is among tracking.backends (the "
            "default) and after its first logged step.",
        )
    if out_dir is None:
        out_dir = runs[0].dir / ("report" if len(runs) == 1 else "report-compare")
    return write_report(runs, out_dir)
