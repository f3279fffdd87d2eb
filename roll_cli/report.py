"""`roll report`: PNG plots of runs' metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from roll_cli.common import Debug, RunsDir, handle_errors

out = Console(soft_wrap=True, highlight=False)


@handle_errors
def report_command(
    run_ids: Annotated[
        list[str], typer.Argument(help="Run ids to plot (several: overlaid).", show_default=False)
    ],
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Directory for the PNGs (default: RUN/report, or RUN/report-compare for "
            "several runs, in the first run's directory).",
        ),
    ] = None,
    runs_dir: RunsDir = Path("runs"),
    debug: Debug = False,
) -> None:
    """Plot reward/accuracy, loss, KL, entropy, response length and time split per step."""
    from roll_core.tracking.report import report_runs

    report = report_runs(run_ids, runs_dir=runs_dir, out_dir=out_dir)
    for path in report.files:
        out.print(str(path))
    out.print(f"plotted data: {report.out_dir / 'report.json'}")
