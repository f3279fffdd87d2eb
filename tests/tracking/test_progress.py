"""Phases (loading, warm start, evaluation) on and off a terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from roll_core.tracking.console import ConsoleTracker
from roll_core.tracking.progress import phase


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_a_phase_says_when_it_starts_and_how_long_it_took() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    clock = FakeClock()
    with phase(console, "loading models", clock=clock):
        clock.now = 3.25
    assert buf.getvalue().splitlines() == ["loading models ...", "loading models: done in 3.2s"]


def test_a_counted_phase_prints_about_ten_progress_lines() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    clock = FakeClock()
    with phase(console, "warm start", total=20, clock=clock) as p:
        for _ in range(20):
            clock.now += 1.0
            p.advance()
    lines = buf.getvalue().splitlines()
    # every 20 // 10 = 2 steps, the last one (20/20) is the summary instead
    assert lines[1] == "warm start 2/20  (2.0s)"
    assert lines[-2] == "warm start 18/20  (18.0s)"
    assert lines[-1] == "warm start (20): done in 20.0s"
    assert len(lines) == 1 + 9 + 1


def test_brief_phase_is_silent_when_quick() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    clock = FakeClock()
    with phase(console, "evaluating", brief=True, clock=clock):
        clock.now = 0.5
    with phase(console, "evaluating", brief=True, clock=clock):
        clock.now = 2.5
    assert buf.getvalue().splitlines() == ["evaluating: done in 2.0s"]


def test_a_failed_phase_prints_no_summary() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    with pytest.raises(RuntimeError), phase(console, "loading data"):
        raise RuntimeError("boom")
    assert buf.getvalue().splitlines() == ["loading data ..."]


def test_on_a_terminal_a_phase_draws_into_the_live_training_bar() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=True)
    tracker = ConsoleTracker(total_steps=4, console=console)
    live = tracker.live_progress
    assert live is not None
    with phase(console, "evaluating", progress=live) as p:
        assert len(live.tasks) == 2  # the bar and the phase, one live display
        p.advance()
    assert len(live.tasks) == 1
    tracker.close()
    assert tracker.live_progress is None
    assert "evaluating: done in" in buf.getvalue()
