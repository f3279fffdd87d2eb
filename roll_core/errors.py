"""Errors a user can cause and fix.

Every error raised for bad input (a recipe typo, a missing file, an unknown name, a damaged
checkpoint) is a :class:`RollError`. The CLI prints its one-paragraph message and exits with
``exit_code``; it shows a traceback only under ``--debug``. Anything else that escapes is a bug.
"""

from __future__ import annotations


class RollError(Exception):
    """An error caused by input the user can fix. ``str(err)`` is the whole message."""

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n{hint}")


class ConfigError(RollError):
    """A recipe or override that does not validate (exit code 2, like any usage error)."""

    exit_code = 2


class UsageError(RollError):
    """A command-line mistake: a missing file, an unknown run id or name (exit code 2)."""

    exit_code = 2


class DataError(RollError):
    """A dataset that cannot be read or does not have the columns the recipe names."""

    exit_code = 2


class ModelError(RollError):
    """A model or tokenizer that cannot be found or loaded."""

    exit_code = 2


class CheckpointError(RollError):
    """No usable checkpoint, or one that cannot be written."""

    exit_code = 1


class Interrupted(RollError):
    """The user stopped a command (Ctrl-C / SIGTERM): not a failure. The CLI prints it as
    ``stopped: ...`` (never ``error:``) and exits with 130."""

    exit_code = 130


class RunDirError(RollError):
    """A run directory that cannot be created or written."""

    exit_code = 1


class WorkerDiedError(RollError):
    """A worker process (a Ray actor or a local subprocess rank) died: killed, out of memory,
    or crashed below Python. The run's driver adds the last good checkpoint and the resume
    command to the message."""

    exit_code = 1

    def __init__(self, role: str, rank: int, detail: str) -> None:
        self.role = role
        self.rank = rank
        self.detail = detail
        super().__init__(f"worker {role} rank {rank} died ({detail}).")


class SandboxError(RollError):
    """A sandbox that cannot be created or has failed (no namespaces where isolation is
    required, disk full, a supervisor that died): the machine's fault or the setup's, never
    the sandboxed command's."""

    exit_code = 1
