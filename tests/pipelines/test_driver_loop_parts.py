"""Checkpoint parts registered once with the DriverLoop (pipelines/common.py): saved by
name, restored on resume, in the layout earlier runs wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from roll_core.config.schema import SFTConfig
from roll_core.engine.plan import make_plan
from roll_core.errors import CheckpointError
from roll_core.pipelines.common import TRAINER_STATE, DriverLoop
from roll_core.runs import Run


class Counter:
    """A JSON part: a number."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class Weights:
    """A file part: writes `weights.txt` into the checkpoint directory."""

    def __init__(self, text: str = "") -> None:
        self.text = text

    def save_checkpoint(self, ckpt: Path) -> None:
        (ckpt / "weights.txt").write_text(self.text)

    def load_checkpoint(self, ckpt: Path) -> None:
        self.text = (ckpt / "weights.txt").read_text()


def _cfg() -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {"train": {"path": "train.jsonl"}},
            "trainer": {"max_steps": 4},
            "tracking": {"backends": ["jsonl"]},
        }
    )


def _loop(run: Run, *, resume: bool) -> DriverLoop:
    cfg = _cfg()
    return DriverLoop(cfg, run, plan=make_plan(cfg), resume=resume)


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run.create(
        tmp_path, config_yaml="{}\n", name="t", pipeline="sft", command=["roll"], recipe=None
    )


def test_parts_are_saved_by_name_and_restored(run: Run) -> None:
    loop = _loop(run, resume=False)
    loop.expect_data(10, "prompts")
    loop.register("counter", Counter(7))
    loop.register("weights", Weights("w=1.5"))
    assert loop.begin() == 0
    path = loop.save(2)
    loop.close("interrupted")
    state = json.loads((path / TRAINER_STATE).read_text())
    assert state == {"train_size": 10, "counter": {"value": 7}, "step": 2}
    assert (path / "weights.txt").read_text() == "w=1.5"

    again = _loop(run, resume=True)
    counter, weights = Counter(), Weights()
    again.expect_data(10, "prompts")
    again.register("counter", counter)
    again.register("weights", weights)
    assert again.begin() == 2
    again.close(None)
    assert (counter.value, weights.text) == (7, "w=1.5")


def test_resume_refuses_other_data_and_missing_parts(run: Run) -> None:
    loop = _loop(run, resume=False)
    loop.expect_data(10, "prompts")
    loop.register("counter", Counter(1))
    loop.begin()
    loop.save(1)
    loop.close("interrupted")

    other = _loop(run, resume=True)
    other.expect_data(12, "prompts")
    with pytest.raises(CheckpointError, match="it had 10 prompts, now 12"):
        other.begin()

    newer = _loop(run, resume=True)
    newer.register("counter", Counter())
    newer.register("source", Counter())
    with pytest.raises(CheckpointError, match="no saved 'source' state"):
        newer.begin()

    optional = _loop(run, resume=True)
    kept = Counter(5)
    optional.register("counter", Counter())
    optional.register("source", kept, required=False)
    assert optional.begin() == 1
    optional.close(None)
    assert kept.value == 5  # not in the checkpoint: left as it was


def test_register_refuses_duplicates_and_late_parts(run: Run) -> None:
    loop = _loop(run, resume=False)
    loop.register("counter", Counter())
    with pytest.raises(ValueError, match="registered already"):
        loop.register("counter", Counter())
    loop.begin()
    with pytest.raises(RuntimeError, match="after begin"):
        loop.register("late", Counter())
    loop.close(None)
