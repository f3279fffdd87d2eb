"""The rollout record's files: whole step files only, resume truncation, the size budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.errors import RunDirError
from roll_core.tracking.rollouts import (
    RolloutStore,
    encode_step,
    read_step,
    read_summary,
    recorded_steps,
)


def rows(n: int) -> list[dict]:
    return [{"row": i, "reward": 0.5 * i, "tokens": ["a", "b"]} for i in range(n)]


def test_a_step_file_is_its_summary_then_one_line_per_row(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, max_mb=1)
    assert store.write(3, {"rows": 2}, rows(2))
    text = (tmp_path / "rollouts/step-000003.jsonl").read_text()
    assert text.splitlines()[0] == '{"step": 3, "summary": {"rows": 2}}'
    assert [json.loads(x)["reward"] for x in text.splitlines()[1:]] == [0.0, 0.5]
    head, got = read_step(tmp_path, 3)
    assert head == {"step": 3, "summary": {"rows": 2}} and got == rows(2)
    assert read_summary(tmp_path, 3) == head
    assert recorded_steps(tmp_path) == [3]


def test_nan_and_inf_are_written_as_null(tmp_path: Path) -> None:
    text = encode_step(1, {"m": float("nan")}, [{"lp": [1.0, float("-inf")]}])
    assert text == '{"step": 1, "summary": {"m": null}}\n{"lp": [1.0, null]}\n'


def test_resume_drops_the_steps_after_the_checkpoint_and_a_killed_write(tmp_path: Path) -> None:
    store = RolloutStore(tmp_path, max_mb=1)
    for step in (1, 2, 3, 4):
        store.write(step, {}, rows(1))
    # a kill during a write leaves its temporary file, never a torn step file
    torn = tmp_path / "rollouts/.step-000005.jsonl.tmp-123"
    torn.write_text('{"step": 5, "summ')
    assert recorded_steps(tmp_path) == [1, 2, 3, 4]
    resumed = RolloutStore(tmp_path, max_mb=1)
    resumed.truncate_after(2)  # resumed from checkpoint step-2: steps 3, 4 are done again
    assert recorded_steps(tmp_path) == [1, 2] and not torn.exists()
    one = len(encode_step(1, {}, rows(1)).encode())
    assert resumed.used == 2 * one
    assert resumed.write(3, {"again": True}, rows(1))
    assert read_summary(tmp_path, 3)["summary"] == {"again": True}


def test_the_budget_stops_the_record_for_good(tmp_path: Path) -> None:
    size = len(encode_step(1, {}, rows(1)).encode())  # every step file here has this size
    store = RolloutStore(tmp_path, max_mb=2.5 * size / 2**20)  # room for two files
    assert store.write(1, {}, rows(1)) and store.write(2, {}, rows(1))
    assert not store.write(3, {}, rows(1)) and store.full
    assert not store.write(4, {}, []), "a smaller later step is not written either"
    assert recorded_steps(tmp_path) == [1, 2]
    # resuming a run whose budget is spent: still spent
    again = RolloutStore(tmp_path, max_mb=2 * size / 2**20)
    again.truncate_after(2)
    assert again.full and again.used == 2 * size


def test_a_damaged_file_is_a_run_dir_error(tmp_path: Path) -> None:
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts/step-000001.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(RunDirError, match="line 2 is not a rollout record"):
        read_step(tmp_path, 1)
