"""`roll view`: the rollout records of a run (or two, compared) in a browser."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from roll_cli.common import Debug, RunsDir, handle_errors

out = Console(soft_wrap=True, highlight=False)


@handle_errors
def view_command(
    run_ids: Annotated[
        list[str],
        typer.Argument(help="A run id, or two to compare on the same prompts.", show_default=False),
    ],
    port: Annotated[
        int, typer.Option("--port", help="Port on localhost to serve the page on (0: any free).")
    ] = 0,
    export: Annotated[
        Path | None,
        typer.Option(
            "--export", help="Write one self-contained HTML file instead of serving the page."
        ),
    ] = None,
    runs_dir: RunsDir = Path("runs"),
    debug: Debug = False,
) -> None:
    """See each step's rollouts: groups, rewards, per-token log-probs and advantages,
    episodes (docs/view.md)."""
    from roll_core.tracking.viewer import view

    def ready(url: str) -> None:
        out.print(f"roll view: {url}  (Ctrl-C to stop)", markup=False)

    try:
        written = view(run_ids, runs_dir=runs_dir, export_to=export, port=port, ready=ready)
    except KeyboardInterrupt:
        return
    if written is not None:
        out.print(str(written), markup=False)
