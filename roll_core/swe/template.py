"""The repository template type of the SWE task generator."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RepoTemplate"]


@dataclass(frozen=True)
class RepoTemplate:
    """A small pure-Python package with a passing pytest suite."""

    name: str
    """The repository's name (task ids start with it)."""

    files: dict[str, str]
    """Relative path -> text: the package's modules and its visible ``tests/``."""

    probes: dict[str, list[str]]
    """Module (dotted) -> snippets whose last line is an expression; the hidden tests assert
    each expression equals its value on the original code."""

    def modules(self) -> list[str]:
        """The package's module files (not ``__init__`` or tests), sorted."""
        return sorted(
            p
            for p in self.files
            if p.endswith(".py")
            and "/" in p
            and not p.startswith("tests/")
            and not p.endswith("__init__.py")
        )
