"""MODEL_OR_RUN resolution: builtin, model / checkpoint / run directories, run ids, hub ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.errors import ModelError, UsageError
from roll_core.evaluation import resolve_model_or_run
from roll_core.runs import CheckpointManager, Run


def make_run(runs: Path, rid: str, *, final: bool = False, config: str = "pipeline: sft\n") -> Run:
    run = Run.create(
        runs, config_yaml=config, name="t", pipeline="sft", command=[], recipe=None, run_id=rid
    )
    if final:
        (run.dir / "final").mkdir()
        (run.dir / "final" / "config.json").write_text("{}")
    return run


def checkpoint(run: Run, step: int, sub: str = "actor_train/model") -> Path:
    def write(tmp: Path) -> None:
        (tmp / sub).mkdir(parents=True)
        (tmp / sub / "config.json").write_text("{}")
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))

    return CheckpointManager(run.checkpoints_dir).save(step, write)


def test_builtin_and_hub_ids_pass_through(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_model_or_run("builtin:tiny-qwen3").path == "builtin:tiny-qwen3"
    assert resolve_model_or_run("Qwen/Qwen3-0.6B").path == "Qwen/Qwen3-0.6B"


def test_run_id_prefers_final_and_reads_the_config(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r1", final=True, config="pipeline: rlvr\ndata: {system_prompt: Hi}\n")
    checkpoint(run, 4)
    model = resolve_model_or_run("r1", runs_dir=tmp_path)
    assert model.path == str((run.dir / "final").resolve())
    assert model.label == "run r1 (final)" and model.run is not None
    assert model.setting("data", "system_prompt") == "Hi"
    assert model.setting("data", "missing") is None


def test_run_without_final_uses_its_newest_checkpoint(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r2")
    checkpoint(run, 2)
    checkpoint(run, 4)
    model = resolve_model_or_run("r2", runs_dir=tmp_path)
    assert model.path.endswith("step-000004/actor_train/model")
    assert model.label == "run r2 (step-000004)"


def test_checkpoint_and_run_directories(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r3", final=True)
    ckpt = checkpoint(run, 3)
    from_ckpt = resolve_model_or_run(str(ckpt))
    assert from_ckpt.path.endswith("step-000003/actor_train/model")
    assert from_ckpt.run is not None and from_ckpt.run.id == "r3"
    assert resolve_model_or_run(str(run.dir)).label == "run r3 (final)"
    model_dir = run.dir / "final"
    assert resolve_model_or_run(str(model_dir)).path == str(model_dir.resolve())


def test_sharded_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r4")
    checkpoint(run, 1, sub="actor_train/dcp")
    with pytest.raises(ModelError, match="FSDP2 weights"):
        resolve_model_or_run("r4", runs_dir=tmp_path)


def test_run_with_nothing_saved(tmp_path: Path) -> None:
    make_run(tmp_path, "r5")
    with pytest.raises(ModelError, match="no final model and no checkpoint"):
        resolve_model_or_run("r5", runs_dir=tmp_path)


def test_unknown_names(tmp_path: Path, monkeypatch) -> None:
    make_run(tmp_path / "runs", "real-run")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="Recent runs: real-run") as info:
        resolve_model_or_run("reel-run")
    assert info.value.exit_code == 2
    with pytest.raises(ModelError, match="model path not found"):
        resolve_model_or_run("runs/reel-run")  # runs/ exists here: a path, not a hub id
    with pytest.raises(ModelError):
        resolve_model_or_run(str(tmp_path / "runs"))  # a directory with no model
