"""What every `roll` command module shares: the consoles, the argument types and the error
handler. main and the command modules import it (not each other), so there is no import cycle."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.text import Text

from roll_core.tracking.terminal import make_console

out = make_console()  # off a terminal: no wrapping, no cut cells (CI logs, `| tee`)
err = make_console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

Recipe = Annotated[Path, typer.Argument(help="Recipe YAML file.", show_default=False)]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="Overrides: key.path=value (e.g. trainer.max_steps=10).", show_default=False
    ),
]
DryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run", help="Validate, print the resolved config and the resource plan, exit."
    ),
]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]
RunId = Annotated[str | None, typer.Option("--run-id", help="Name the run (default: generated).")]
RunsDir = Annotated[
    Path,
    typer.Option("--runs-dir", help="Directory holding run directories.", envvar="ROLL_RUNS_DIR"),
]


def handle_errors(fn: F) -> F:
    """Turn RollError into `error: ...` + exit code; anything else into a short bug report."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from roll_core.errors import Interrupted, RollError

        debug = bool(kwargs.get("debug")) or os.environ.get("ROLL_DEBUG") == "1"
        try:
            return fn(*args, **kwargs)
        except RollError as e:
            if debug:
                traceback.print_exc()
            stopped = isinstance(e, Interrupted)  # the user asked for it: not an error
            _say("stopped: " if stopped else "error: ", e.message, "yellow" if stopped else "red")
            if e.hint:
                _say("", e.hint)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            _say("stopped", "", "yellow")
            raise typer.Exit(130) from None
        except Exception as e:  # a bug, not bad input
            if debug:
                traceback.print_exc()
            _say("internal error: ", f"{type(e).__name__}: {e}", "red")
            _say("", "This is a bug in roll; rerun with --debug for the traceback and report it.")
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _say(label: str, message: str, style: str = "", *, console: Any = None) -> None:
    """``label`` (styled) then ``message`` verbatim: no rich markup is read from it, so
    ``pip install roll[wandb]`` keeps its brackets, and no line is wrapped off a terminal."""
    text = Text(label, style=f"bold {style}".strip() if style else "") + Text(message)
    (console or err).print(text, highlight=False, soft_wrap=True)
