"""The order colocated roles take turns in (roll_core/pipelines/turns.py), read off a real
in-process run of rlvr and of agentic (local executor, tiny model, every offload on): each
worker call is recorded as it happens."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from roll_core.config import load_recipe
from roll_core.engine.weight_sync import WeightSync
from roll_core.engine.worker import Worker
from roll_core.pipelines import launch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ALL_ON = {
    "actor_train": {
        "num_threads": 1,
        "offload": {"optimizer": True, "grads": True, "params": True},
    },
    "actor_infer": {"num_threads": 1, "offload": {"weights": True, "kv_cache": True}},
}
KEPT = {
    "generate",
    "generate_request",
    "offload",
    "reload",
    "log_probs",
    "token_stats",
    "train_step",
    "save",
    "export",
}
"""The calls whose order is the turn order (memory probes, RNG reads ... are left out)."""

ONE_STEP = [
    "ActorInfer.generate",
    "ActorInfer.offload(weights,kv_cache)",  # inference frees its memory
    "ActorTrain.reload",  # training state back
    "ActorTrain.train_step",  # (old log-probs come from the update itself here)
    "ActorTrain.offload(optimizer,grads)",
    "ActorInfer.reload(weights)",
    "sync",  # the weight sync reads the params ...
    "ActorTrain.offload(params)",  # ... before they leave
    "ActorInfer.reload(kv_cache)",
]


def _record(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    lock = threading.Lock()
    original = Worker.call

    def call(self: Worker, method: str, *args: object, **kwargs: object) -> object:
        if method in KEPT:
            # streaming requests and deterministic chunks are both "generate" in the order
            kind = "generate" if method == "generate_request" else method
            name = f"{type(self).__name__}.{kind}"
            if method in ("offload", "reload") and args:
                name += f"({','.join(args[0])})"  # type: ignore[arg-type]
            with lock:
                if not calls or calls[-1] != name:  # one entry per call of all ranks
                    calls.append(name)
        return original(self, method, *args, **kwargs)

    def sync(self: WeightSync, version: int) -> dict[str, float]:
        with lock:
            calls.append("sync")  # on any path (same_process calls the ranks directly)
        return original_sync(self, version)

    original_sync = WeightSync.sync
    monkeypatch.setattr(Worker, "call", call)
    monkeypatch.setattr(WeightSync, "sync", sync)
    return calls


def _steps(calls: list[str]) -> list[list[str]]:
    """The calls cut at each rollout's first generate (after the initial sync)."""
    starts = [i for i, c in enumerate(calls) if c == "ActorInfer.generate"]
    starts = [s for k, s in enumerate(starts) if k == 0 or calls[s - 1] != "ActorInfer.generate"]
    return [calls[a:b] for a, b in zip(starts, [*starts[1:], len(calls)], strict=True)]


def test_rlvr_phase_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    recipe = {
        "pipeline": "rlvr",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 32},
            "max_prompt_length": 64,
        },
        "rollout": {"n": 2, "prompts_per_step": 2, "max_new_tokens": 3},
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}},
        "trainer": {"max_steps": 2, "micro_batch_size": 8},
        "checkpoint": {"every_steps": 1},
        "tracking": {"backends": ["jsonl"], "rollout_records": {"enabled": False}},
        **ALL_ON,
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe))
    calls = _record(monkeypatch)
    launch(load_recipe(path, []), recipe=str(path), run_id="order")
    # the initial sync, then the params leave (start of the first generation turn)
    assert calls[:2] == [
        "sync",
        "ActorTrain.offload(optimizer,grads,params)",
    ]
    first, second = _steps(calls)
    # a checkpoint (every step) is written in a training turn of its own, then back
    save = [
        "ActorInfer.offload(weights,kv_cache)",
        "ActorTrain.reload",
        "ActorTrain.save",
        "ActorTrain.offload(optimizer,grads)",
        "ActorInfer.reload(weights)",
        "ActorTrain.offload(params)",
        "ActorInfer.reload(kv_cache)",
    ]
    assert first == ONE_STEP + save
    export = [*save[:2], "ActorTrain.export", *save[3:]]
    assert second == ONE_STEP + save + export


def test_agentic_phase_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    recipe = {
        "pipeline": "agentic",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "envs": [
            {
                "env": "frozen_lake",
                "options": {"size": 3, "max_steps": 2},
                "system_prompt": "Lake. Answer Up, Down, Left or Right.",
                "groups_per_step": 1,
            }
        ],
        "rollout": {"group_size": 2, "max_new_tokens": 4},
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}},
        "trainer": {"max_steps": 2, "micro_batch_size": 8},
        "checkpoint": {"export_final": False},
        "tracking": {"backends": ["jsonl"]},
        **ALL_ON,
    }
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(recipe))
    calls = _record(monkeypatch)
    launch(load_recipe(path, []), recipe=str(path), run_id="order")
    first, second = _steps(calls)
    save = [  # the final checkpoint, in a training turn of its own
        "ActorInfer.offload(weights,kv_cache)",
        "ActorTrain.reload",
        "ActorTrain.save",
        "ActorTrain.offload(optimizer,grads)",
        "ActorInfer.reload(weights)",
        "ActorTrain.offload(params)",
        "ActorInfer.reload(kv_cache)",
    ]
    # the rollout records (on by default) take the trainer's log-probs of their rows in the
    # training turn, before the update (which computes the old log-probs itself)
    recorded = [*ONE_STEP[:3], "ActorTrain.token_stats", *ONE_STEP[3:]]
    assert first == recorded
    assert second == recorded + save
