"""The source of a sandbox supervisor: the shared confinement and namespace code, then its own.

A supervisor is a standard-library-only script started as ``python -I -S -c <source>`` in a
new session with an empty environment; it is never imported. Two use it: the code reward's
test-case runner (:mod:`roll_core.rewards._sandbox_supervisor`) and the SWE workspace
sandbox's command runner (:mod:`roll_core.sandbox._exec_supervisor`). Both start from
:mod:`roll_core.sandbox._confine` (seccomp, Landlock) and
:mod:`roll_core.sandbox._namespaces` (user/mount/network/PID namespaces, a private root,
dropped capabilities), so a fix to either reaches both sandboxes.
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["supervisor_source"]

_HERE = Path(__file__).resolve().parent
_SHARED = ("_confine.py", "_namespaces.py")


@functools.cache
def supervisor_source(own: Path) -> str:
    """The full source of the supervisor whose own part (its ``main()``) is the file ``own``."""
    parts = [(_HERE / name).read_text(encoding="utf-8") for name in _SHARED]
    return "\n".join([*parts, own.read_text(encoding="utf-8")])
