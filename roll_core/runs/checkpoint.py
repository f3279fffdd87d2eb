"""Atomic checkpoints with a `latest` pointer and fallback past damaged ones.

A checkpoint is written into `checkpoints/.tmp-step-NNNNNN-<pid>/`, gets a `manifest.json`
(size and sha256 of every file), is fsync'ed and renamed to `step-NNNNNN/`; only then is the
`latest` pointer replaced (a one-line text file, written atomically). A crash or SIGKILL at any
moment leaves the previous checkpoint complete and pointed to. Loading verifies the manifest
and falls back to the newest checkpoint that verifies, saying which one it skipped and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from roll_core.errors import CheckpointError
from roll_core.runs.failure import EXPLAINED, release_files, write_failure
from roll_core.runs.run import atomic_write_text, normal_file_modes

MANIFEST = "manifest.json"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync_tree(root: Path) -> None:
    for p in [*_files(root), root / MANIFEST]:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault_injection(step: int, hook: str = "ROLL_DEBUG_KILL_IN_SAVE") -> None:
    """Test hooks: `ROLL_DEBUG_KILL_IN_SAVE=N` SIGKILLs this process mid-save of step N (after
    the files are written, before the manifest and rename), to prove saves are atomic;
    `ROLL_DEBUG_KILL_BEFORE_PRUNE=N` once step N is published, before older ones are pruned."""
    if os.environ.get(hook) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def verify(ckpt: Path) -> str | None:
    """None when `ckpt` is complete and intact, else the reason it is not."""
    manifest_path = ckpt / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "manifest.json is unreadable"
    for rel, info in files.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != info["size"]:
            return f"{rel} has the wrong size"
        if _sha256(path) != info["sha256"]:
            return f"{rel} checksum mismatch"
    return None


@dataclass
class Resumable:
    """The checkpoint to resume from and the damaged ones skipped on the way."""

    path: Path
    step: int
    skipped: list[tuple[str, str]]
    note: str | None = None
    """What a fallback did that the caller should say (e.g. a missing `latest` pointer)."""


class CheckpointManager:
    """Saves, prunes and finds checkpoints under one run's `checkpoints/` directory."""

    def __init__(self, root: Path, keep_last: int = 2) -> None:
        self.root = root
        self.keep_last = keep_last

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Call `write(tmp_dir)` to fill a checkpoint, then publish it atomically.

        A failed write leaves no staging directory and the earlier checkpoints and `latest`
        as they were. A filesystem error (disk full or read-only, also one a writer such as
        torch.save reports as a RuntimeError: `write_failure`) is raised as an OSError naming
        the checkpoint, for `explain_failure`; another errno (EIO) as a CheckpointError;
        anything else (a bug) propagates as it is.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            write(tmp)
            normal_file_modes(tmp)
            _fault_injection(step)
            files = {
                str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                for p in _files(tmp)
            }
            atomic_write_text(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException as err:
            cause = write_failure(err, tmp)  # before the partial files that filled the disk go
            release_files(err)  # the writer's open files: their space comes back
            shutil.rmtree(tmp, ignore_errors=True)
            if cause is None:
                raise
            if cause.errno in EXPLAINED:  # named the checkpoint, not its deleted staging
                raise OSError(cause.errno, cause.strerror, str(final)) from err
            raise CheckpointError(
                f"could not write checkpoint {final}: {cause.strerror or cause}.",
                hint="Check the disk holding the run directory; earlier checkpoints are untouched.",
            ) from err
        atomic_write_text(self.root / LATEST, final.name + "\n")
        _fault_injection(step, "ROLL_DEBUG_KILL_BEFORE_PRUNE")
        self.prune(keep=final)
        return final

    def _complete(self) -> list[Path]:
        dirs = [p for p in self.root.glob("step-*") if p.is_dir()] if self.root.is_dir() else []
        return sorted(dirs, key=lambda p: p.name, reverse=True)

    def prune(self, keep: Path) -> None:
        """Keep the `keep_last` newest checkpoints and `keep`; remove older ones and staging
        left by a killed save. Called after every save and when a run resumes (a kill between
        publishing a checkpoint and pruning left one too many). An old checkpoint is renamed
        to a hidden `.tmp-` name before it is deleted, so a kill mid-delete never leaves a
        torn `step-*` directory, only staging the next prune removes."""
        for old in self._complete()[self.keep_last :]:
            if old != keep:
                doomed = self.root / f".tmp-pruned-{old.name}-{os.getpid()}"
                try:
                    os.rename(old, doomed)
                except OSError:  # e.g. removed by hand meanwhile: nothing left to delete
                    continue
                shutil.rmtree(doomed, ignore_errors=True)
        for tmp in self.root.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def latest_pointer(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        return self.root / name if name else None

    def _pointer_note(self, pointed: Path | None, chosen: Path) -> str | None:
        if pointed is not None:
            return None  # the pointer was used, or the skipped list says why not
        pointer = self.root / LATEST
        what = "is empty" if pointer.is_file() else "is missing"
        return (
            f"checkpoints/{LATEST} {what}; using the newest complete checkpoint, {chosen.name} "
            "(it will be rewritten at the next save)."
        )

    def find_resumable(self) -> Resumable | None:
        """The newest intact checkpoint (the `latest` one first), or None when there is none."""
        candidates: list[Path] = []
        pointed = self.latest_pointer()
        if pointed is not None:
            candidates.append(pointed)
        candidates += [p for p in self._complete() if p not in candidates]
        skipped: list[tuple[str, str]] = []
        for cand in candidates:
            reason = verify(cand) if cand.is_dir() else "directory is missing"
            if reason is None:
                manifest = json.loads((cand / MANIFEST).read_text())
                note = self._pointer_note(pointed, cand)
                return Resumable(path=cand, step=int(manifest["step"]), skipped=skipped, note=note)
            skipped.append((cand.name, reason))
        if skipped:
            raise CheckpointError(
                "every checkpoint of this run is damaged: "
                + "; ".join(f"{n}: {r}" for n, r in skipped)
                + ".",
                hint="Start a new run from the recipe (the run's config.yaml); nothing was deleted.",
            )
        return None
