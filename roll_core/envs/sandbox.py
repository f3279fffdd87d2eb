"""The tools of the tool-use env: a calculator and a Python runner in a limited subprocess.

The calculator evaluates arithmetic with :mod:`ast` (numbers, ``+ - * / // % **``, parentheses
and ``abs round min max sqrt``), never ``eval``: an expression cannot reach a name or an
attribute, and huge powers are refused before they are computed.

:func:`run_python` never runs code in the calling process. It writes the code into a fresh
temporary directory and runs ``python -I`` there, in a new session, with an empty environment,
stdout and stderr in a file, and resource limits the child sets on itself before the code
runs (both soft and hard, so the code cannot raise them again): address space
(``memory_mb``), CPU seconds, output file size, open files and, where the kernel supports it,
no new processes. A wall-clock ``timeout`` kills the whole process group. These limits stop
runaway loops, memory blow-ups, fork bombs and floods of output; they are not a security
boundary against hostile code (the network and the file system stay reachable): run untrusted
models' code in a container or a VM.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.sandbox.host import kill_group

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
}
_MAX_MAGNITUDE = 1e100


def calculate(expression: str) -> str:
    """Evaluate an arithmetic ``expression``; the result as text (``7``, ``3.5``).

    ``^`` means power, ``x`` between numbers, ``×`` and ``÷`` are accepted. Raises ValueError
    with a short reason for anything that is not arithmetic or cannot be computed.
    """
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    text = text.replace(",", "") if "(" not in text else text  # 1,000 + 2 reads as 1000 + 2
    if not text:
        raise ValueError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression.strip()!r} as arithmetic") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result too large") from None
    return format_number(value)


def format_number(value: float | int) -> str:
    """``6.0`` -> ``6``, ``3.5`` -> ``3.5``, ``1/3`` -> ``0.333333333333``."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise ValueError("result is not a finite number")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (
            abs(right) > 1000 or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 100)
        ):
            raise ValueError("power too large")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex) or abs(result) > _MAX_MAGNITUDE:
            raise ValueError("result too large or not real")
        return result
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        try:
            return _FUNCTIONS[node.func.id](*(_eval(a) for a in node.args))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{node.func.id}: {err}") from None
    shown = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
    raise ValueError(
        f"{shown!r} is not allowed (numbers, + - * / // % **, parentheses, {', '.join(_FUNCTIONS)})"
    )


@dataclass(frozen=True)
class PythonResult:
    """What :func:`run_python` observed."""

    output: str  # stdout and stderr interleaved, cut to max_output characters
    exit_code: int | None  # None when killed for the timeout; negative: killed by that signal
    timed_out: bool
    truncated: bool

    @property
    def ok(self) -> bool:
        """True when the program ran to completion with exit code 0."""
        return self.exit_code == 0 and not self.timed_out

    def describe(self) -> str:
        """The result as the model sees it: output plus a note on how the program ended."""
        notes = []
        if self.timed_out:
            notes.append("stopped: the time limit was reached")
        elif self.exit_code is not None and self.exit_code < 0:
            sig = -self.exit_code
            why = _SIGNAL_REASONS.get(sig)
            notes.append(f"killed by signal {sig}" + (f" ({why})" if why else ""))
        elif self.exit_code:
            notes.append(f"exit code {self.exit_code}")
        if self.truncated:
            notes.append("output truncated")
        text = self.output.rstrip("\n") if self.output.strip() else "(no output)"
        return text + "".join(f"\n[{n}]" for n in notes)


_SIGNAL_REASONS: dict[int, str] = {
    signal.SIGXCPU: "the CPU time limit",
    signal.SIGXFSZ: "the output size limit",
    signal.SIGKILL: "a resource limit",
    signal.SIGSEGV: "a crash",
}

# Runs in the child: set the limits on itself (soft = hard, so they cannot be raised again),
# then run main.py as __main__.
_LAUNCHER = r"""
import resource, sys
mem, cpu, fsize = (int(v) for v in sys.argv[1:4])
limits = [(resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
          (resource.RLIMIT_NOFILE, 64)]
if hasattr(resource, "RLIMIT_NPROC"):
    limits.append((resource.RLIMIT_NPROC, 0))
for which, value in limits:
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        pass
del resource, limits, mem, cpu, fsize
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as f:
    source = f.read()
try:
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as err:  # the traceback without this launcher's frame
    import traceback
    traceback.print_exception(type(err), err, err.__traceback__.tb_next)
    sys.exit(1)
"""


def run_python(
    code: str,
    *,
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_output: int = 2000,
    python: str | None = None,
) -> PythonResult:
    """Run ``code`` in a fresh, resource-limited ``python -I`` subprocess (never in-process).

    ``timeout`` is wall-clock seconds (the process group is killed when it passes),
    ``memory_mb`` the address-space limit, ``max_output`` the characters of output kept.
    """
    with tempfile.TemporaryDirectory(prefix="roll-python-tool-") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code, encoding="utf-8")
        out_path = work / "output.txt"
        env = {
            "PATH": os.defpath,
            "HOME": tmp,
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        cpu = max(1, math.ceil(timeout)) + 1
        fsize = max(4 * max_output, 64 * 1024)
        args = [
            python or sys.executable,
            "-I",
            "-c",
            _LAUNCHER,
            str(memory_mb << 20),
            str(cpu),
            str(fsize),
        ]
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                args,
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_group(proc)
        with open(out_path, "rb") as f:  # at most fsize bytes, unless the limit did not apply
            raw = f.read(fsize).decode("utf-8", errors="replace")
    output, truncated = _cut(raw, max_output)
    return PythonResult(output, None if timed_out else proc.returncode, timed_out, truncated)


def _cut(text: str, limit: int) -> tuple[str, bool]:
    """Keep the head and the tail (where a traceback's last line is) of a long output."""
    if len(text) <= limit:
        return text, False
    head = limit * 2 // 3
    tail = limit - head
    return text[:head] + "\n...\n" + text[-tail:], True
