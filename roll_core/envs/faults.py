"""Env faults: an env call that raises or hangs, told as the env's error (not roll's).

Whoever drives an env (``roll debug-env``, the agentic rollout, the warm start) calls it
through :func:`call_with_timeout` and describes a failure with :func:`describe_fault`: the
exception's type and message and the innermost frame of the traceback (the line of the env's
code that raised), e.g. ``ValueError: bad move (at my_envs/maze.py:42, in on_step)``.
:class:`EnvFault` is the :class:`~roll_core.errors.RollError` a command raises when an env
fault stops it, so the CLI prints it as the env's error with exit code 1.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from roll_core.errors import RollError


class EnvTimeout(Exception):
    """An env call ran past its timeout."""


class EnvFault(RollError):
    """A user env raised or hung; the run (or ``debug-env``) stops with the env's error.

    ``metrics`` holds the fault counters gathered up to the stop, for the caller to log.
    """

    exit_code = 1

    def __init__(
        self, message: str, *, hint: str | None = None, metrics: dict[str, float] | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.metrics: dict[str, float] = dict(metrics or {})


def call_with_timeout(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """``fn(*args)`` on a daemon thread; EnvTimeout if it has not returned after ``timeout`` s.

    A hung call cannot be killed (it is a thread); it is abandoned and its env is never used
    again.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            box["error"] = err

    thread = threading.Thread(target=target, name="env-call", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout))
    if thread.is_alive():
        name = getattr(fn, "__name__", "call")
        raise EnvTimeout(f"env {name}() did not return within {timeout:.3g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def fault_location(err: BaseException, in_file: str | None = None) -> str:
    """``path:line, in function`` of the innermost frame of ``err``'s traceback ('' if none);
    with ``in_file``, the innermost frame in that file if there is one (a user module's own
    line, rather than the library line deep inside a call it made).

    The path is relative to the working directory when it lies below it.
    """
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if in_file and f.filename == in_file] or frames[-1:]
    if not mine:
        return ""
    frame = mine[-1]
    path = Path(frame.filename)
    try:
        shown = str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    return f"{shown}:{frame.lineno}, in {frame.name}"


def describe_fault(err: BaseException, in_file: str | None = None) -> str:
    """One line: ``Type: message (at path:line, in function)``; a timeout is its message.
    ``in_file``: the line shown is the innermost one in that file (see fault_location)."""
    if isinstance(err, EnvTimeout):
        return f"timeout: {err}"
    described = getattr(err, "fault_text", None)  # a fault that says where itself (agents)
    if isinstance(described, str):
        return described
    text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    where = fault_location(err, in_file)
    return f"{text} (at {where})" if where else text
