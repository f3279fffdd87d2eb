"""Fixtures for the run tests: a small real filesystem that fills up (a tmpfs)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class SmallFs:
    """Mounts tmpfs filesystems of a given size (all unmounted after the test)."""

    def __init__(self) -> None:
        self.mounted: list[Path] = []

    def mount(self, directory: Path, size: int) -> Path:
        """A tmpfs of `size` bytes on `directory`; skips the test where mounting is not
        permitted (not root, or a container without CAP_SYS_ADMIN)."""
        directory.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {(res.stderr or res.stdout).strip()}")
        self.mounted.append(directory)
        return directory

    @staticmethod
    def free(directory: Path) -> int:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize

    @staticmethod
    def ballast(path: Path, size: int) -> Path:
        """A file that takes `size` bytes of its disk (written, not sparse)."""
        with open(path, "wb") as f:
            for _ in range(size // (1 << 20)):
                f.write(b"\1" * (1 << 20))
            f.write(b"\1" * (size % (1 << 20)))
        return path

    def unmount_all(self) -> None:
        for directory in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True)
        self.mounted.clear()


@pytest.fixture
def small_fs() -> Iterator[SmallFs]:
    """A disk that really fills up, so writers fail as they do on a full disk (torch.save with
    a RuntimeError, safetensors with a SafetensorError, open() with ENOSPC)."""
    fs = SmallFs()
    try:
        yield fs
    finally:
        fs.unmount_all()
