"""A person playing `roll debug-env` at the terminal: arrow keys for grid games, typed lines
with readline editing, pastes, Ctrl-D to quit (:class:`HumanPolicy`); without a terminal, one
action per line of stdin."""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Mapping
from typing import IO, Any

from rich.console import Console
from rich.text import Text

out = Console(highlight=False)

# ---- human play ------------------------------------------------------------------------------
# Names of the keys an escape sequence may stand for (CSI ``ESC [ params final`` or SS3
# ``ESC O final``); keys without a name here are read whole and ignored.
_KEY_NAMES: Mapping[str, str] = {"A": "up", "B": "down", "C": "right", "D": "left"}


class HumanPolicy:
    """A person at the terminal: arrow keys for grid games, else typed lines; Ctrl-D quits.

    With a terminal on stdin and an env that maps arrow keys (``env.key_actions``), one key
    press is one action; any other key starts a typed action finished with Enter. Without a
    terminal, each line of stdin is one action. For key play the terminal stays in cbreak
    mode (keys are read one by one, not echoed) from the first episode until :meth:`close`,
    so keys pressed while a turn is printed are neither echoed nor lost.

    Typed actions are read with GNU readline (Python's ``input``): line editing (Backspace,
    Delete, arrows, Home/End, Ctrl-A/E/U/W), a history of earlier actions, and echo of pasted
    text, with no new dependency and nothing that takes over the screen (prompt_toolkit
    would, and rich prints every turn). The key that started a typed action, and whatever was
    pasted with it, is handed to readline as the line's start, so it is shown and editable.
    """

    name = "human"

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.keys: Mapping[str, str] = {}
        self._saved: list[Any] | None = None  # terminal attributes to restore

    @property
    def _editing(self) -> bool:
        """Whether typed lines go through readline (stdin and stdout are a terminal)."""
        return self.stream is sys.stdin and self.stream.isatty() and sys.stdout.isatty()

    def start(self, env: Any, seed: int) -> None:
        self.keys = env.key_actions
        if self.keys and self.stream.isatty() and self._saved is None:
            import termios
            import tty

            self._saved = termios.tcgetattr(self.stream.fileno())
            tty.setcbreak(self.stream.fileno())

    def close(self) -> None:
        """Give the terminal its settings back."""
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.stream.fileno(), termios.TCSADRAIN, self._saved)
            self._saved = None

    def turn_info(self) -> dict[str, Any]:
        return {}

    def act(self, observation: str) -> str | None:
        if self._saved is not None:
            return self._read_key_action()
        return self._read_line("action (Enter to send, Ctrl-D quits)> ")

    def _read_line(self, prompt: str, start: str = "") -> str | None:
        """One typed line (``start``: text already typed, shown and editable); None at EOF."""
        if self._editing:
            return _edit_line(prompt, start)
        if prompt:
            out.print(prompt, end="", style="bold")
        line = self.stream.readline()
        if not line:  # EOF: Ctrl-D or the end of piped input
            out.print()
            return None
        if not self.stream.isatty():  # no terminal echoed it: show what was read
            out.print(Text(line.rstrip("\n")))
        return start + line.rstrip("\n")

    def _read_key_action(self) -> str | None:
        import termios
        import tty

        out.print(
            "move (arrow keys, or type an action + Enter; q or Ctrl-D quits)> ",
            end="",
            style="bold",
        )
        fd = self.stream.fileno()
        while True:
            key = _read_key(fd)
            if key in ("q", "\x04", ""):
                out.print()
                return None
            if key in self.keys:
                out.print(self.keys[key])
                return self.keys[key]
            if len(key) != 1 or not key.isprintable():
                continue  # Enter, Backspace, PgUp, Delete, ...: nothing to act on yet
            typed = key + _pending(fd)  # the rest of a paste arrives with its first key
            line, ended, _ = typed.replace("\n", "\r").partition("\r")
            if ended:  # a pasted action with its Enter: it is complete
                shown = _printable(line)
                out.print(Text(shown))
                return shown
            assert self._saved is not None
            termios.tcsetattr(fd, termios.TCSANOW, self._saved)
            try:
                out.print()  # readline redraws the prompt with the text typed so far
                return self._read_line("action> ", _printable(line))
            finally:
                tty.setcbreak(fd)


def _edit_line(prompt: str, start: str) -> str | None:
    """``input(prompt)`` with readline editing, the line pre-filled with ``start``."""
    import readline

    def prefill() -> None:
        readline.insert_text(start)
        readline.redisplay()

    readline.set_pre_input_hook(prefill if start else None)
    sys.stdout.flush()
    try:
        # \001 and \002 tell readline the bold escapes take no room on the screen
        return input(f"\001\x1b[1m\002{prompt}\001\x1b[0m\002")
    except EOFError:  # Ctrl-D on an empty line
        out.print()
        return None
    finally:
        readline.set_pre_input_hook(None)


def _printable(text: str) -> str:
    """``text`` with control characters dropped and Backspace applied (a pasted line)."""
    kept: list[str] = []
    for ch in text:
        if ch in ("\x7f", "\b"):
            if kept:
                kept.pop()
        elif ch.isprintable():
            kept.append(ch)
    return "".join(kept)


def _pending(fd: int) -> str:
    """Bytes already waiting on ``fd`` (the rest of a paste or of fast typing), decoded."""
    data = b""
    while select.select([fd], [], [], 0.02)[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def _read_key(fd: int) -> str:
    """One key press from a terminal in cbreak mode: a character, ``up``/``down``/``left``/
    ``right``, or another escape sequence read whole (``\x1b[5~`` for PgUp, ``\x1b[3~`` for
    Delete, ...) so that none of its bytes is taken for a typed key."""
    data = os.read(fd, 1)
    if not data:
        return ""
    if data == b"\x1b":
        return _read_escape(fd)
    if data[0] >= 0x80:  # the rest of a UTF-8 character
        while select.select([fd], [], [], 0.01)[0] and len(data) < 4:
            data += os.read(fd, 1)
    return data.decode(errors="replace")


def _read_escape(fd: int) -> str:
    """The rest of an escape sequence after ESC (its bytes arrive together, within 50 ms).

    CSI (``ESC [``) runs to a final byte in ``@``..``~`` after any parameter bytes; SS3
    (``ESC O``) is one more byte; ``ESC x`` is Alt+x; a lone ESC is the Escape key.
    """

    def byte() -> bytes:
        return os.read(fd, 1) if select.select([fd], [], [], 0.05)[0] else b""

    intro = byte()
    if intro == b"[":
        body = b""
        while True:
            b = byte()
            if not b:
                break
            body += b
            if 0x40 <= b[0] <= 0x7E:
                break
        seq = "\x1b[" + body.decode(errors="replace")
        params, final = body[:-1], body[-1:].decode(errors="replace")
        plain = params in (b"", b"1") or params.startswith(b"1;")  # 1;5: with Ctrl etc.
        return _KEY_NAMES[final] if final in _KEY_NAMES and plain else seq
    if intro == b"O":
        final = byte().decode(errors="replace")
        return _KEY_NAMES.get(final, "\x1bO" + final)
    return "\x1b" + intro.decode(errors="replace")
