"""Run directories, run ids, atomic checkpoints and resume."""

from roll_core.runs.checkpoint import CheckpointManager, Resumable, step_dir_name, verify
from roll_core.runs.run import Run, atomic_write_text, list_runs, new_run_id

__all__ = [
    "CheckpointManager",
    "Resumable",
    "Run",
    "atomic_write_text",
    "list_runs",
    "new_run_id",
    "step_dir_name",
    "verify",
]
