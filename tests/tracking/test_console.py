"""The console tracker with a non-terminal console (CI, pipes) and a forced terminal."""

from __future__ import annotations

import io

from rich.console import Console

from roll_core.tracking.console import (
    ConsoleTracker,
    bar_metrics,
    eval_metrics,
    format_eval_line,
    format_value,
    key_metric,
    summary_metrics,
    time_split_line,
)


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
    tracker = ConsoleTracker(total_steps=2, console=console, plain_every=1)
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


# ---- RL metrics, eval dedup, time split, ETA, ticks ---------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bar_shows_rlvr_reward_accuracy_kl_entropy_in_bar_order() -> None:
    shown = bar_metrics(
        {
            "actor/entropy": 2.5,
            "actor/kl_loss": 0.0125,
            "reward/math/accuracy": 0.75,
            "reward/math/count": 32.0,
            "rollout/reward_mean": 0.5,
            "perf/tokens_per_s": 1234.6,
        }
    )
    assert list(shown.items()) == [
        ("reward", "0.5"),
        ("acc", "0.75"),
        ("kl", "0.0125"),
        ("entropy", "2.5"),
        ("tok/s", "1,235"),
    ]


def test_bar_shows_agentic_success_and_return_and_accuracy_per_domain() -> None:
    assert bar_metrics({"rollout/success_rate": 0.25, "rollout/episode_return": -1.5}) == {
        "success": "0.25",
        "return": "-1.5",
    }
    two = bar_metrics({"reward/math/accuracy": 0.5, "reward/code/accuracy": 0.125})
    assert two == {"acc/math": "0.5", "acc/code": "0.125"}


def test_eval_line_drops_bookkeeping_and_repeated_scores() -> None:
    # one reward domain: accuracy, reward_mean, math/mean and math/accuracy are one number
    evals = {
        "eval/math/count": 16.0,
        "eval/math/errors": 0.0,
        "eval/math/timeouts": 0.0,
        "eval/math/mean": 0.5,
        "eval/math/accuracy": 0.5,
        "eval/reward_mean": 0.5,
        "eval/accuracy": 0.5,
        "eval/response_length_mean": 6.0,
    }
    assert eval_metrics(evals) == {"eval/accuracy": 0.5, "eval/response_length_mean": 6.0}
    # two domains with different scores keep both; a non-zero error count is shown
    two = {
        "eval/math/accuracy": 0.75,
        "eval/code/accuracy": 0.25,
        "eval/code/errors": 2.0,
        "eval/accuracy": 0.5,
    }
    assert eval_metrics(two) == two
    # SFT keys pass unchanged
    sft = {"eval/loss": 1.23, "eval/exact_match": 0.45}
    assert eval_metrics(sft) == sft


def test_time_split_line_sums_parts_and_gives_shares() -> None:
    metrics = {
        "time/rollout": 3.0,
        "rollout/reward_s": 0.5,
        "time/reference": 0.25,
        "time/old_log_prob": 0.75,  # log-probs 1.0
        "time/train": 0.5,
        "sync/seconds": 0.5,  # total 3 + 1 + 0.5 + 0.5 = 5
    }
    assert time_split_line(10, metrics) == (
        "time step 10: rollout 3.00s 60% (reward scoring 0.50s, overlapped)  "
        "log-probs 1.00s 20%  train 0.50s 10%  sync 0.50s 10%  = 5.00s"
    )
    assert time_split_line(1, {"train/loss": 1.0}) is None  # SFT: no parts


def test_time_split_is_printed_every_n_steps_off_a_terminal() -> None:
    console, buf = _plain_console()
    tracker = ConsoleTracker(total_steps=4, console=console, plain_every=100, time_split_every=2)
    for step in range(1, 5):
        tracker.log(step, {"time/rollout": 1.0, "time/train": 1.0})
    tracker.close()
    splits = [x for x in buf.getvalue().splitlines() if x.startswith("time step")]
    assert [x.split(":")[0] for x in splits] == ["time step 2", "time step 4"]


def test_bar_advances_on_unlogged_steps_and_eta_starts_at_the_second_step() -> None:
    console, buf = _plain_console()
    clock = FakeClock()
    tracker = ConsoleTracker(total_steps=10, console=console, plain_every=1, clock=clock)
    clock.now += 50.0  # a slow first step (warm-up) is not part of the estimate
    tracker.tick(1)
    assert tracker.eta() is None
    assert tracker._progress.tasks[0].completed == 1  # the bar moved on an unlogged step
    clock.now += 2.0
    tracker.tick(2)
    assert tracker.eta() == 2.0 * 8  # 2 s per step since step 1, 8 steps left
    clock.now += 4.0
    tracker.log(3, {"train/loss": 0.5})
    assert tracker.eta() == 3.0 * 7  # (2 + 4) / 2 steps, 7 left
    tracker.close()
    # off a terminal only logged steps print (an unlogged step's metrics would be stale)
    assert buf.getvalue().splitlines() == ["train 3/10  elapsed 0:00:56  eta 0:00:21  loss 0.5"]
    assert tracker._progress.tasks[0].completed == 3


def test_summary_and_key_metric_prefer_eval_scores() -> None:
    metrics = {"train/loss": 0.5, "rollout/reward_mean": 0.25, "eval/accuracy": 0.75}
    assert summary_metrics(metrics) == {
        "eval/accuracy": 0.75,
        "rollout/reward_mean": 0.25,
        "train/loss": 0.5,
    }
    assert key_metric(metrics) == "eval/accuracy 0.75"
    assert key_metric({"rollout/success_rate": 0.5}) == "rollout/success_rate 0.5"
    assert key_metric({}) == ""
