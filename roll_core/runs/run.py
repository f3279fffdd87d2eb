"""Run directories: `runs/<run-id>/` with the resolved config, meta, metrics and checkpoints.

```
runs/<run-id>/
  config.yaml        resolved recipe (every default filled in)
  meta.json          command, versions, git sha, status, step
  metrics.jsonl      one line per logged step
  tensorboard/ swanlab/
  checkpoints/step-000020/ ... checkpoints/latest
  final/             the exported Hugging Face model
```
Run ids are short and typeable: `<adjective>-<noun>-<2 digits>`, e.g. `brisk-otter-42`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core import __version__
from roll_core.errors import RunDirError, UsageError

_ADJECTIVES = (
    "amber bold brisk calm clever crisp dapper eager fair fancy gentle glad grand happy jolly "
    "keen lively lucky merry mighty nimble noble plucky proud quick quiet rapid ready shiny "
    "sly snappy solid steady sunny swift tidy vivid warm wise witty zesty"
).split()
_NOUNS = (
    "otter falcon badger heron lynx marten panda raven tiger walrus yak zebra bison crane "
    "dingo eagle ferret gecko ibis koala lemur moose newt orca puffin quail robin seal "
    "stork tapir viper wombat beaver cobra finch hare mole owl"
).split()

STATUSES = ("running", "finished", "failed", "interrupted")


def new_run_id(runs_dir: Path, rng: random.Random | None = None) -> str:
    """A fresh id not used in `runs_dir`."""
    rng = rng or random.SystemRandom()  # type: ignore[assignment]
    for _ in range(1000):
        rid = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}-{rng.randrange(100):02d}"
        if not (runs_dir / rid).exists():
            return rid
    raise RunDirError(f"could not find a free run id in {runs_dir}; clean up old runs.")


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file so readers see the old or the new content, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # name the file the caller meant, not the temporary one
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(err.errno, err.strerror, str(path)) from err


def normal_file_modes(root: Path) -> None:
    """Give every file under `root` the mode a plain `open(path, "w")` there gets (0666 less
    the umask): some writers (safetensors) create their files 0600, which would make an
    export or checkpoint unreadable to the group and others when every other file is not."""
    probe = root / f".mode-probe-{os.getpid()}"
    probe.touch()
    try:
        mode = probe.stat().st_mode & 0o777
    finally:
        probe.unlink()
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            os.chmod(path, mode)


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _versions() -> dict[str, str]:
    versions = {"roll": __version__, "python": platform.python_version()}
    for mod in ("torch", "transformers", "ray"):
        module = sys.modules.get(mod)
        if module is not None:
            versions[mod] = getattr(module, "__version__", "?")
    # The CPU and the kernel level torch picked for it: results are bit-exact for one install
    # on one CPU type, not across CPU types (the kernels round differently).
    versions["cpu"] = _cpu_name()
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return versions


def _cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo on Linux, else what platform says)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@dataclass
class Run:
    """One run directory. Create with :meth:`create`, reopen with :meth:`open`."""

    dir: Path

    def __post_init__(self) -> None:
        # Absolute, always: the paths a run hands to its ranks (checkpoints, the export) must
        # not depend on the working directory of the process that receives them (a Ray worker
        # of a joined cluster starts in the cluster's directory, not the driver's).
        self.dir = Path(self.dir).absolute()

    @property
    def id(self) -> str:
        return self.dir.name

    @property
    def config_path(self) -> Path:
        return self.dir / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.dir / "checkpoints"

    # ---- creation and lookup -------------------------------------------------------------
    @classmethod
    def create(
        cls,
        runs_dir: str | Path,
        *,
        config_yaml: str,
        name: str,
        pipeline: str,
        command: list[str],
        recipe: str | None,
        run_id: str | None = None,
    ) -> Run:
        root = Path(runs_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
            rid = run_id or new_run_id(root)
            (root / rid).mkdir(exist_ok=False)
        except FileExistsError:
            raise UsageError(f"run id {run_id!r} already exists in {root}.") from None
        except OSError as err:
            raise RunDirError(
                f"cannot create a run directory in {root}: {err.strerror or err}.",
                hint="Choose a writable place with `runs_dir=PATH` (or the recipe's runs_dir).",
            ) from None
        run = cls(root / rid)
        atomic_write_text(run.config_path, config_yaml)
        now = time.time()
        meta = {
            "id": rid,
            "name": name,
            "pipeline": pipeline,
            "recipe": recipe,
            "command": command,
            "status": "running",
            "step": 0,
            "created": now,
            "updated": now,
            "versions": _versions(),
            "git_sha": _git_sha(),
            "resumes": [],
        }
        run.write_meta(meta)
        return run

    @classmethod
    def open(cls, runs_dir: str | Path, run_id: str) -> Run:
        root = Path(runs_dir)
        run = cls(root / run_id)
        if not (run.dir / "meta.json").is_file():
            recent = [r.id for r in list_runs(root)[:5]]
            listing = f" Recent runs: {', '.join(recent)}." if recent else " There are no runs."
            raise UsageError(
                f"no run {run_id!r} in {root.resolve()}.{listing}",
                hint="`roll runs` lists runs; pass `--runs-dir` if they live elsewhere.",
            )
        run.meta()  # a damaged meta.json is refused before anything is loaded or written
        return run

    # ---- meta ------------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """meta.json as a dict; a damaged one is a RunDirError for this run only (an OSError,
        e.g. a deleted run directory, propagates for the caller to explain)."""
        path = self.dir / "meta.json"
        try:
            meta = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            reason = f"not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        except UnicodeDecodeError:
            reason = "not valid JSON (not UTF-8 text)"
        else:
            if isinstance(meta, dict) and isinstance(meta.get("resumes", []), list):
                return meta
            reason = "not a JSON object with the run's fields"
        raise RunDirError(
            f"run {self.id}: {path} is damaged: {reason}. Nothing was changed; the run's "
            "checkpoints, metrics and config.yaml are untouched.",
            hint="Repair meta.json by hand (it holds the status, step and command of the run) "
            "or move the run directory out of the runs directory.",
        )

    def write_meta(self, meta: dict[str, Any]) -> None:
        atomic_write_text(self.dir / "meta.json", json.dumps(meta, indent=2) + "\n")

    def update_meta(self, **fields: Any) -> dict[str, Any]:
        meta = self.meta()
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"unknown status {fields['status']!r}")
        meta.update(fields, updated=time.time())
        self.write_meta(meta)
        return meta

    def record_resume(self, *, command: list[str], from_step: int, checkpoint: str | None) -> None:
        meta = self.meta()
        meta.setdefault("resumes", []).append(
            {
                "time": time.time(),
                "command": command,
                "from_step": from_step,
                "checkpoint": checkpoint,
            }
        )
        meta.update(status="running", step=from_step, updated=time.time())
        self.write_meta(meta)


def list_runs(runs_dir: str | Path) -> list[Run]:
    """Runs in `runs_dir`, newest first."""
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    runs = [Run(p) for p in root.iterdir() if (p / "meta.json").is_file()]
    return sorted(runs, key=_created, reverse=True)


def _created(run: Run) -> float:
    """When `run` was created (a run with a damaged meta.json sorts by its directory's mtime)."""
    try:
        return float(run.meta().get("created", 0))
    except (RunDirError, TypeError, ValueError):
        return run.dir.stat().st_mtime
