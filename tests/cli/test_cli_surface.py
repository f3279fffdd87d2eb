"""The CLI surface is frozen: every command and subcommand of `roll`, its help text, and each
of its arguments and options (names, type, default, help) must match tests/cli/cli_surface.txt,
so that a change to the surface is a deliberate one (as torchtitan's
tests/unit_tests/test_no_new_cli_options.py does).

The snapshot is built from the click command tree Typer makes (the raw help strings, not a
rendering), so it does not depend on the terminal width or on rich's layout.

After a deliberate change, regenerate the snapshot and commit it with the change:

    python tests/cli/test_cli_surface.py --update
    # or: ROLL_UPDATE_CLI_SURFACE=1 pytest tests/cli/test_cli_surface.py
"""

from __future__ import annotations

import enum
import os
import sys
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).with_name("cli_surface.txt")
REGENERATE = "python tests/cli/test_cli_surface.py --update"


def _value(value: Any) -> str:
    """A default as text that is the same on every machine and Python version."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return repr(value)


def _type(param: Any) -> str:
    """The parameter's Python type as Typer reads it (an enum: its choices), with bounds."""
    annotation = param.type_descriptor.annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        text = "choice(" + "|".join(str(m.value) for m in annotation) + ")"
    elif isinstance(annotation, type):
        text = annotation.__name__
    else:
        text = str(annotation).replace("typing.", "").replace("pathlib.", "")
    bounds = [
        f"{k}={getattr(param, k)!r}" for k in ("min", "max") if getattr(param, k, None) is not None
    ]
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _param(param: Any) -> list[str]:
    kind = str(param.param_type_name)  # "argument" or "option"
    names = " / ".join([*param.opts, *param.secondary_opts]) if kind == "option" else param.name
    facts = [f"type {_type(param)}"]
    if param.required:
        facts.append("required")
    else:
        facts.append(f"default {_value(param.default)}")
    if param.multiple:
        facts.append("multiple")
    if param.nargs != 1:
        facts.append(f"nargs {param.nargs}")
    if getattr(param, "is_flag", False):
        facts.append("flag")
    if getattr(param, "hidden", False):
        facts.append("hidden")
    show_default = getattr(param, "show_default", None)
    if show_default is not None:
        facts.append(f"show_default {show_default!r}")
    lines = [f"  {kind} {names}: " + ", ".join(facts)]
    help_text = getattr(param, "help", None)
    if help_text:
        lines += [("    | " + line).rstrip() for line in help_text.strip().splitlines()]
    return lines


def _command(path: str, command: Any) -> list[str]:
    lines = [f"command {path}" + (" (hidden)" if command.hidden else "")]
    if command.help:
        lines += [("  | " + line).rstrip() for line in command.help.strip().splitlines()]
    for param in command.params:
        if param.name in ("help", "install_completion", "show_completion"):
            continue  # Typer's own, not roll's surface
        lines += _param(param)
    lines.append("")
    if hasattr(command, "commands"):  # a group: its subcommands, by name
        for name in sorted(command.commands):
            lines += _command(f"{path} {name}", command.commands[name])
    return lines


def surface() -> str:
    """The whole `roll` command tree as text."""
    import typer.main

    from roll_cli.main import app

    return "\n".join(_command("roll", typer.main.get_command(app))).rstrip() + "\n"


def test_cli_surface_is_unchanged() -> None:
    now = surface()
    if os.environ.get("ROLL_UPDATE_CLI_SURFACE"):
        SNAPSHOT.write_text(now, encoding="utf-8")
    frozen = SNAPSHOT.read_text(encoding="utf-8")
    if now != frozen:
        import difflib

        diff = "".join(
            difflib.unified_diff(
                frozen.splitlines(keepends=True),
                now.splitlines(keepends=True),
                fromfile=str(SNAPSHOT.name),
                tofile="roll_cli now",
            )
        )
        raise AssertionError(
            "the CLI surface changed: if deliberate, regenerate with `"
            + REGENERATE
            + "` (or ROLL_UPDATE_CLI_SURFACE=1 pytest tests/cli/test_cli_surface.py) and commit "
            "tests/cli/cli_surface.txt with the change; if not, undo the change to the "
            "commands, options or help text shown here:\n" + diff
        )


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {REGENERATE}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    SNAPSHOT.write_text(surface(), encoding="utf-8")
    print(f"wrote {SNAPSHOT}")
