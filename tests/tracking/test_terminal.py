"""Consoles and tables off a terminal: nothing wrapped, nothing cut."""

from __future__ import annotations

import io

from rich.console import Console

from roll_core.tracking.terminal import PLAIN_WIDTH, is_live, make_console, print_table


def test_make_console_off_a_terminal_never_wraps(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    console = make_console()  # pytest captures stdout: not a terminal
    assert not console.is_terminal and console.width == PLAIN_WIDTH and console.soft_wrap
    long = "final model (Hugging Face format): /" + "a" * 150
    with console.capture() as cap:
        console.print(long)
    assert cap.get() == long + "\n"


def test_plain_table_keeps_every_cell_whole_and_aligns_columns() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=30)  # narrow and not a terminal
    assert not is_live(console)
    rows = [["jolly-hero-20261124-055201", "finished", "eval/accuracy 0.742"], ["b", "", "x"]]
    print_table(console, "runs in runs", ["id", "status", "key metric"], rows)
    assert buf.getvalue().splitlines() == [
        "runs in runs",
        "id                          status    key metric",
        "jolly-hero-20261124-055201  finished  eval/accuracy 0.742",
        "b                                     x",
    ]


def test_terminal_table_is_a_rich_table() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True)
    print_table(console, "built-in models", ["name"], [["builtin:tiny-qwen3"]])
    out = buf.getvalue()
    assert "builtin:tiny-qwen3" in out and "┃" in out
