"""The console tracker with a non-terminal console (CI, pipes) and a forced terminal."""

from __future__ import annotations

import io

from rich.console import Console

from roll_core.tracking.console import ConsoleTracker, format_eval_line, format_value


def _plain_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=120), buf


def test_eval_line_format() -> None:
    line = format_eval_line(200, {"eval/loss": 1.23, "eval/exact_match": 0.45})
    assert line == "step 200  eval/loss 1.23  eval/exact_match 0.45"
    assert format_value(7) == "7"
    assert format_value(0.123456) == "0.1235"


def test_non_tty_prints_a_plain_line_every_n_steps_and_eval_lines() -> None:
    console, buf = _plain_console()
    assert not console.is_terminal
    tracker = ConsoleTracker(total_steps=10, console=console, plain_every=5)
    for step in range(1, 11):
        metrics = {"train/loss": 1.0 / step, "perf/tokens_per_s": 1234.4}
        if step == 5:
            metrics |= {"eval/loss": 1.23, "eval/exact_match": 0.45}
        tracker.log(step, metrics)
    tracker.close()
    tracker.close()

    lines = buf.getvalue().splitlines()
    assert lines[0] == "step 5  eval/loss 1.23  eval/exact_match 0.45"
    assert lines[1].startswith("train 5/10  elapsed 0:00:0")
    assert lines[1].endswith("loss 0.2  tok/s 1,234")
    assert lines[2].startswith("train 10/10  ")
    assert lines[2].endswith("loss 0.1  tok/s 1,234")
    assert len(lines) == 3  # modest: no redraws, no bar characters
    assert "━" not in buf.getvalue()


def test_non_tty_default_cadence_is_about_twenty_lines_and_close_prints_last_step() -> None:
    console, buf = _plain_console()
    tracker = ConsoleTracker(total_steps=200, console=console)
    for step in range(1, 124):  # interrupted at step 123
        tracker.log(step, {"train/loss": 0.5})
    tracker.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 123 // 10 + 1
    assert lines[-1].startswith("train 123/200  ")


def test_resume_starts_the_count_at_start_step() -> None:
    console, buf = _plain_console()
    tracker = ConsoleTracker(total_steps=10, start_step=6, console=console, plain_every=1)
    tracker.log(7, {"train/loss": 0.25})
    tracker.close()
    assert buf.getvalue().startswith("train 7/10  ")


def test_key_metrics_keep_their_last_value_and_missing_ones_are_left_out() -> None:
    console, buf = _plain_console()
    tracker = ConsoleTracker(
        total_steps=2, console=console, key_metrics=("train/loss", "actor/kl"), plain_every=1
    )
    tracker.log(1, {"train/loss": 3})
    tracker.log(2, {"other": 1.0})
    tracker.close()
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith("loss 3") and "kl" not in lines[0] and "tok/s" not in lines[0]
    assert lines[1].endswith("loss 3")


def test_terminal_console_draws_a_bar_and_stops() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    tracker = ConsoleTracker(total_steps=4, console=console)
    for step in range(1, 5):
        tracker.log(step, {"train/loss": 0.5, "perf/tokens_per_s": 10.0})
    tracker.log(4, {"eval/loss": 0.75})
    tracker.close()
    out = buf.getvalue()
    assert "train" in out and "4/4" in out and "loss 0.5" in out and "tok/s 10" in out
    assert "step 4  eval/loss 0.75" in out
