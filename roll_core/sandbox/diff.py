"""Unified diffs between two directory trees, in the form ``git apply`` takes, and their files.

Only regular text files count: symlinks, devices, FIFOs, files over :data:`MAX_FILE_BYTES`
and files that are not UTF-8 are left out (listed in :attr:`TreeDiff.skipped`), and so are
caches (``__pycache__``, ``*.pyc``, ``.pytest_cache``) and ``.git``. Reading never follows a
symlink and never blocks on a FIFO a sandboxed program left in the tree.
"""

from __future__ import annotations

import difflib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MAX_FILE_BYTES", "TreeDiff", "diff_trees", "diff_paths", "split_diff"]

MAX_FILE_BYTES = 1 << 20
IGNORED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".git", ".mypy_cache", ".ruff_cache"})
IGNORED_SUFFIXES = (".pyc", ".pyo")


@dataclass
class TreeDiff:
    """A diff and the paths it could not represent."""

    text: str = ""
    skipped: list[str] = field(default_factory=list)


def _files(root: Path, skipped: list[str]) -> dict[str, int]:
    """Relative path -> mode of every regular file under ``root`` (nothing followed)."""
    found: dict[str, int] = {}
    if not root.is_dir():
        return found
    for top, dirs, names in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS)
        for name in sorted(names):
            if name.endswith(IGNORED_SUFFIXES):
                continue
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                found[rel] = st.st_mode
            else:
                skipped.append(rel)
    return found


def _read(path: Path) -> bytes | None:
    """A regular file's bytes, or None (too big, gone, or not a regular file any more)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _text(data: bytes | None) -> list[str] | None:
    if data is None or b"\0" in data:
        return None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def _hunks(old: list[str], new: list[str]) -> str:
    out = []
    lines = difflib.unified_diff(old, new, lineterm="", n=3)
    for i, line in enumerate(lines):
        if i < 2:  # difflib's own ---/+++ lines: ours are written by the caller
            continue
        if line.startswith("@@"):
            out.append(line + "\n")
        elif line.endswith("\n"):
            out.append(line)
        else:
            out.append(line + "\n\\ No newline at end of file\n")
    return "".join(out)


def diff_paths(rel: str, old: list[str] | None, new: list[str] | None, mode: int = 0o644) -> str:
    """One file's section: ``old`` None is a new file, ``new`` None a deleted one."""
    kind = "100755" if mode & 0o111 else "100644"
    head = f"diff --git a/{rel} b/{rel}\n"
    if old is None:
        head += f"new file mode {kind}\n"
        old_name, new_name = "/dev/null", f"b/{rel}"
    elif new is None:
        head += f"deleted file mode {kind}\n"
        old_name, new_name = f"a/{rel}", "/dev/null"
    else:
        old_name, new_name = f"a/{rel}", f"b/{rel}"
    body = _hunks(old or [], new or [])
    if not body:
        return head if old is None or new is None else ""
    return f"{head}--- {old_name}\n+++ {new_name}\n{body}"


def diff_trees(old_root: Path, new_root: Path) -> TreeDiff:
    """How ``new_root`` differs from ``old_root`` (paths relative to each root)."""
    result = TreeDiff()
    old_files = _files(old_root, [])
    new_files = _files(new_root, result.skipped)
    sections = []
    for rel in sorted(set(old_files) | set(new_files)):
        old = _text(_read(old_root / rel)) if rel in old_files else None
        new = _text(_read(new_root / rel)) if rel in new_files else None
        if (rel in old_files and old is None) or (rel in new_files and new is None):
            result.skipped.append(rel)  # binary, too big or unreadable: not diffable
            continue
        if old == new:
            continue
        sections.append(diff_paths(rel, old, new, new_files.get(rel, old_files.get(rel, 0))))
    result.text = "".join(sections)
    return result


def split_diff(text: str) -> list[tuple[str, str]]:
    """A diff's per-file sections as (path, section); the path is the ``b/`` side (the
    ``a/`` side for a deletion). Text before the first ``diff --git`` line is dropped."""
    sections: list[tuple[str, str]] = []
    current: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith("diff --git "):
            if current:
                sections.append(_section(current))
            current = [line]
        elif current:
            current.append(line)
    if current:
        sections.append(_section(current))
    return sections


def _section(lines: list[str]) -> tuple[str, str]:
    path = ""
    for line in lines[1:]:
        if line.startswith("+++ b/"):
            path = line[6:].rstrip("\n")
            break
        if line.startswith("--- a/"):
            path = line[6:].rstrip("\n")
    if not path:  # no hunks (an empty new file): the header names it
        header = lines[0].rstrip("\n")[len("diff --git ") :]
        path = header.split(" b/", 1)[-1] if " b/" in header else header
    return path, "".join(lines)
