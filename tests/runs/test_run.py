"""Run directories: ids, meta, status, lookup errors."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from roll_core.errors import RunDirError, UsageError
from roll_core.runs import Run, list_runs, new_run_id


def make(tmp_path: Path, run_id: str | None = None) -> Run:
    return Run.create(
        tmp_path,
        config_yaml="a: 1\n",
        name="n",
        pipeline="sft",
        command=["roll"],
        recipe="r.yaml",
        run_id=run_id,
    )


def test_run_ids_are_short_and_typeable(tmp_path: Path) -> None:
    rid = new_run_id(tmp_path, random.Random(0))
    assert re.fullmatch(r"[a-z]+-[a-z]+-\d\d", rid)
    assert len(rid) <= 20


def test_create_writes_config_and_meta(tmp_path: Path) -> None:
    run = make(tmp_path)
    assert run.config_path.read_text() == "a: 1\n"
    meta = run.meta()
    assert meta["status"] == "running" and meta["step"] == 0 and meta["pipeline"] == "sft"
    assert "torch" in meta["versions"] or "python" in meta["versions"]
    run.update_meta(status="finished", step=5)
    assert run.meta()["status"] == "finished"
    with pytest.raises(ValueError):
        run.update_meta(status="exploded")


def test_meta_records_the_cpu_and_torch_kernel_level(tmp_path: Path) -> None:
    """Numbers are bit-exact per CPU type, not across types: meta.json says which one ran."""
    import torch

    versions = make(tmp_path).meta()["versions"]
    assert versions["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(versions["cpu"], str) and versions["cpu"]


def test_run_dir_is_absolute_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paths handed to ranks (Ray workers start in the cluster's directory) never depend on
    the receiving process's working directory."""
    monkeypatch.chdir(tmp_path)
    run = Run.create(
        "runs",
        config_yaml="a: 1\n",
        name="n",
        pipeline="sft",
        command=["roll"],
        recipe=None,
        run_id="abs-path-00",
    )
    assert run.dir == tmp_path / "runs" / "abs-path-00" and run.dir.is_absolute()
    assert Run.open("runs", "abs-path-00").dir == run.dir


def test_open_unknown_lists_recent(tmp_path: Path) -> None:
    make(tmp_path, "known-run-01")
    with pytest.raises(UsageError, match="no run 'nope'.*Recent runs: known-run-01"):
        Run.open(tmp_path, "nope")
    assert [r.id for r in list_runs(tmp_path)] == ["known-run-01"]


def test_duplicate_run_id(tmp_path: Path) -> None:
    make(tmp_path, "same-id-00")
    with pytest.raises(UsageError, match="already exists"):
        make(tmp_path, "same-id-00")


def test_unwritable_runs_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match="cannot create a run directory"):
        make(blocker / "runs")
