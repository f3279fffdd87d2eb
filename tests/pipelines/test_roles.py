"""Every pipeline hands `actor_train`'s backend options and its device_mapping to the workers
it starts (not only to the `--dry-run` plan).

Each case loads a tiny recipe with fsdp2 or deepspeed options and a device_mapping, launches
the real pipeline entry point, and records what the executor is asked to spawn for
actor_train: the backend, its options and the GPU ids of each rank. The spawn of the last
rank stops the run, so no model is loaded and no process is started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roll_core.config.loader import load_recipe
from roll_core.engine.executors import LocalExecutor
from roll_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

RECIPES = {
    "sft": "tiny-arith-sft.yaml",
    "dpo": "tiny-dpo.yaml",
    "distill": "tiny-distill.yaml",
    "rlvr": "tiny-arith-rlvr.yaml",
    "agentic": "tiny-sokoban.yaml",
}

# Non-default values, so the assertion cannot pass on the defaults.
OPTIONS = {
    "fsdp2": {"cpu_offload": True, "reshard_after_forward": False},
    "deepspeed": {"zero_stage": 3, "offload_param": True, "offload_optimizer": True},
}


class _Stop(Exception):
    """Raised by the recording spawn once actor_train's ranks are recorded."""


def _overrides(tmp_path: Path, pipeline: str, backend: str) -> list[str]:
    out = ["model.path=builtin:tiny-qwen3"]
    if pipeline != "agentic":
        out.append("data.train.max_rows=256")
    if pipeline in ("sft", "dpo", "distill"):
        out += ["trainer.micro_batch_size=2", "trainer.grad_accum_steps=1"]
    if pipeline == "distill":
        out.append("teacher.path=builtin:tiny-qwen3")
    out += [
        f"runs_dir={tmp_path / 'runs'}",
        "checkpoint.every_steps=null",
        f"actor_train.backend={backend}",
        "actor_train.world_size=2",
        "actor_train.lora=null",
        "actor_train.device_mapping=[2,3]",
        "executor.num_gpus=4",
        "executor.gpus_per_node=4",
    ]
    out += [f"actor_train.{backend}.{k}={str(v).lower()}" for k, v in OPTIONS[backend].items()]
    return out


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
@pytest.mark.parametrize("pipeline", list(RECIPES))
def test_actor_train_options_and_placement_reach_the_workers(
    pipeline: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from roll_core.pipelines import launch

    spawned: list[dict[str, Any]] = []

    def recording_spawn(
        self: Any, worker_cls: type, *, rank: int, world_size: int, resources: Any, **kw: Any
    ) -> Any:
        if worker_cls.__name__ != "ActorTrain":
            raise AssertionError(f"{worker_cls.__name__} was spawned before actor_train")
        spawned.append({"rank": rank, "resources": dict(resources), **kw})
        if rank == world_size - 1:
            raise _Stop
        return None

    monkeypatch.setattr(LocalExecutor, "spawn", recording_spawn)
    monkeypatch.chdir(ROOT)  # the recipes' data paths are relative to the repository
    cfg = load_recipe(ROOT / "recipes" / RECIPES[pipeline], _overrides(tmp_path, pipeline, backend))
    with pytest.raises(_Stop):
        launch(cfg, recipe=None)

    assert [s["rank"] for s in spawned] == [0, 1]
    for s in spawned:
        kwargs = s["kwargs"]
        assert kwargs["spec"].backend == backend
        options = getattr(kwargs["spec"], backend)
        assert options is not None, f"{pipeline}: actor_train.{backend} options were dropped"
        for key, value in OPTIONS[backend].items():
            assert getattr(options, key) == value, (pipeline, key)
        assert s["isolated"] is True  # a process group, one process per rank
    # device_mapping [2, 3]: rank r runs on GPU 2 + r of a 4-GPU node
    assert [s["resources"].get("gpu_ids") for s in spawned] == [(2,), (3,)]
    assert all(s["resources"].get("gpus_per_node") == 4 for s in spawned)


DROPPED_KEYS = [
    ("sft", ["executor.num_cpus=2"], "executor.num_cpus"),
    ("dpo", ["executor.ray_address=auto"], "executor.ray_address"),
    (
        "rlvr",
        ["executor.type=ray", "executor.ray_address=auto", "executor.num_cpus=2"],
        "executor.num_cpus",
    ),
    ("distill", ["teacher.gradient_checkpointing=true"], "teacher.gradient_checkpointing"),
    ("rlvr", ["critic={}"], "critic"),
]


@pytest.mark.parametrize(("pipeline", "overrides", "key"), DROPPED_KEYS)
def test_a_key_that_cannot_take_effect_is_a_recipe_error(
    pipeline: str, overrides: list[str], key: str
) -> None:
    recipe = ROOT / "recipes" / RECIPES[pipeline]
    load_recipe(recipe, ["model.path=builtin:tiny-qwen3"])  # the recipe as written validates
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_recipe(recipe, ["model.path=builtin:tiny-qwen3", *overrides])


def test_a_dropped_key_exits_2_naming_it(roll) -> None:  # type: ignore[no-untyped-def]
    out = roll("dpo", "recipes/tiny-dpo.yaml", "executor.num_cpus=2", "--dry-run")
    assert out.returncode == 2, out.stderr
    assert "executor.num_cpus" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr
