"""SwanLab in offline mode: no account, no login, no network; everything stays in ``log_dir``.

SwanLab 0.10 has four modes: ``online`` (needs an API key), ``local`` (needs the separate
``swanboard`` dashboard package), ``offline`` and ``disabled``. ``offline`` is the one that
records a full run on disk and never touches the network::

    log_dir/run-<YYYYmmdd_HHMMSS>-<swanlab id>/
        run-<swanlab id>.swanlab     the records (metrics, config, metadata), protobuf log
        files/config.yaml  files/swanlab-metadata.json  media/  debug/debug.log

``swanlab sync <that dir>`` uploads it later from a machine that has an account. The mode is
forced here (a SWANLAB_MODE in the environment or in a config file cannot turn it online) and
interactive prompts are off. SwanLab's terminal capture is off too, since it would wrap
stdout/stderr under the progress bar, and so are the pip / conda / git snapshots, which
``meta.json`` already records. Each start (and each resume) is a new SwanLab run directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError

from .base import Scalar


class SwanLabTracker:
    """Logs scalars to a SwanLab run stored under ``log_dir`` (offline mode)."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        project: str,
        run_name: str,
        config: dict[str, Any],
        *,
        system_metrics: bool = True,
    ) -> None:
        swanlab = _import_swanlab()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        settings = offline_settings(self.log_dir, system_metrics=system_metrics)
        self._run: Any = swanlab.init(
            settings=settings,
            project=project,
            name=run_name,
            config=_plain(config),
            reinit=True,
        )
        self.run_dir = Path(self._run.dir)

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        """Record ``metrics`` at ``step``."""
        if self._run is None:
            raise ValueError(f"SwanLabTracker for {self.log_dir} is closed")
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the SwanLab run (marks it finished and closes its files)."""
        if self._run is not None:
            run, self._run = self._run, None
            if run.alive:
                run.finish()


def offline_settings(log_dir: Path, *, system_metrics: bool = True) -> Any:
    """`swanlab.Settings` for a run that never leaves ``log_dir``."""
    import swanlab

    return swanlab.Settings(
        mode="offline",
        interactive=False,
        log_dir=log_dir,
        terminal=swanlab.Settings.Terminal(proxy_type="none"),
        probe=swanlab.Settings.Probe(
            hardware=system_metrics,
            monitor=system_metrics,
            requirements=False,
            conda=False,
            git=False,
        ),
    )


def _import_swanlab() -> Any:
    try:
        import swanlab
    except ImportError as err:
        raise ConfigError(
            "tracking backend 'swanlab' needs the swanlab package, which is not installed.",
            hint="Run `pip install swanlab`, or remove 'swanlab' from tracking.backends.",
        ) from err
    return swanlab


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as plain JSON types (paths and other objects become strings)."""
    return json.loads(json.dumps(dict(config), default=str))
