"""Sandboxes: isolated workspaces for coding agents and graders (see docs/swe.md).

:mod:`roll_core.sandbox.base` is the interface (:class:`Sandbox`, :class:`SandboxSpec`,
:class:`ExecResult`), :mod:`roll_core.sandbox.local` the local backend. This package imports
only the standard library and :mod:`roll_core.errors`: rewards, envs and data build on it.
"""

from roll_core.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxSpec
from roll_core.sandbox.local import LocalBackend, LocalSandbox

__all__ = ["ExecResult", "LocalBackend", "LocalSandbox", "Sandbox", "SandboxBackend", "SandboxSpec"]
