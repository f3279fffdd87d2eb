"""Weights & Biases, only when the optional ``wandb`` package is installed.

The run is offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads it later); its
files go under ``log_dir/wandb/``. Without ``wandb`` installed, asking for this backend is a
`ConfigError` that says how to fix it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError

from .base import Scalar

DEFAULT_MODE = "offline"


class WandbTracker:
    """Logs scalars to a W&B run (offline by default)."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        project: str,
        run_name: str,
        config: dict[str, Any],
    ) -> None:
        wandb = import_wandb()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=project,
            name=run_name,
            config=dict(config),
            dir=str(self.log_dir),
            mode=os.environ.get("WANDB_MODE", DEFAULT_MODE),
        )

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        """Record ``metrics`` at ``step``."""
        if self._run is None:
            raise ValueError(f"WandbTracker for {self.log_dir} is closed")
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the W&B run."""
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()


def import_wandb() -> Any:
    """The ``wandb`` module, or a `ConfigError` saying how to install it."""
    try:
        import wandb
    except ImportError as err:
        raise ConfigError(
            "tracking backend 'wandb' needs the wandb package, which is not installed.",
            hint="Run `pip install wandb` (or `pip install roll[wandb]`), "
            "or remove 'wandb' from tracking.backends.",
        ) from err
    return wandb
