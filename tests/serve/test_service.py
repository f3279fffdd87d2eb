"""TinkerService in-process: sessions whose heartbeats stop are closed and their models freed;
bad ids and names get the errors the HTTP layer maps to the client's shapes."""

from __future__ import annotations

import time

import pytest

from roll_core.config.serve import ServeConfig
from roll_core.serve.service import NotFound, TinkerService
from roll_core.serve.trainer import UserError


@pytest.fixture
def service(tmp_path):
    cfg = ServeConfig.model_validate(
        {
            "pipeline": "serve",
            "models": [{"name": "tiny", "path": "builtin:tiny-qwen3"}],
            "lora": {"max_rank": 4},
            "train": {"device": "cpu", "num_threads": 1},
            "checkpoints_dir": str(tmp_path / "ckpt"),
            "session_timeout_s": 60,
        }
    )
    svc = TinkerService(cfg)
    yield svc
    svc.close()


def _wait(svc: TinkerService, rid: str) -> dict:
    for _ in range(100):
        out = svc.futures.retrieve(rid, wait_s=1.0)
        if out is not None:
            assert isinstance(out, dict)
            return out
    raise AssertionError(f"{rid} never finished")


def test_a_silent_session_is_closed_and_its_model_freed(service: TinkerService) -> None:
    live = service.create_session({})["session_id"]
    silent = service.create_session({})["session_id"]
    for sid in (live, silent):
        ans = service.create_model(
            {"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2}}
        )
        assert _wait(service, ans["request_id"]) == {
            "type": "create_model",
            "model_id": f"{sid}:train:0",
        }
    assert len(service.models) == 2
    service.sessions[silent].last_seen = time.monotonic() - 61
    service.heartbeat({"session_id": live})
    assert service.reap() == [silent]
    assert list(service.models) == [f"{live}:train:0"]
    with pytest.raises(NotFound, match="unknown session_id"):
        service.heartbeat({"session_id": silent})
    with pytest.raises(NotFound, match="unknown model_id"):
        service.optim_step({"model_id": f"{silent}:train:0", "adam_params": {}})


def test_bad_names_ranks_and_paths(service: TinkerService) -> None:
    sid = service.create_session({})["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "lora_config": {"rank": 2}}
    with pytest.raises(UserError, match="'Qwen/Qwen3-8B' is not served here; served models: tiny"):
        service.create_model({**body, "base_model": "Qwen/Qwen3-8B"})
    with pytest.raises(UserError, match="above this server's max_rank 4"):
        service.create_model({**body, "base_model": "tiny", "lora_config": {"rank": 8}})
    with pytest.raises(UserError, match="full fine-tuning is not served"):
        service.create_model({**body, "base_model": "tiny", "lora_config": None})
    with pytest.raises(UserError, match="not a checkpoint path of this server"):
        service.load_weights({"path": "tinker://x/nope/y", "optimizer": False})
    with pytest.raises(UserError, match="no checkpoint at tinker://x/weights/y"):
        service.load_weights({"path": "tinker://x/weights/y", "optimizer": False})


def test_micro_batches_keep_rows_times_longest_within_the_budget() -> None:
    from roll_core.serve.trainer import _micro_batches

    # [3, 3] -> 2 x 3 = 6; + 5 -> 3 x 5 = 15 > 10; [5] + 10 -> 20 > 10; 12 alone (over budget)
    assert _micro_batches([3, 3, 5, 10, 12], 10) == [[0, 1], [2], [3], [4]]
    assert _micro_batches([2, 2, 2, 2, 2], 10) == [[0, 1, 2, 3, 4]]
    assert _micro_batches([], 10) == []


def test_samplers_beyond_the_limit_close_the_least_recently_used(tmp_path) -> None:
    cfg = ServeConfig.model_validate(
        {
            "pipeline": "serve",
            "models": [{"name": "tiny", "path": "builtin:tiny-qwen3"}],
            "train": {"device": "cpu", "num_threads": 1},
            "sample": {"max_samplers": 2},
            "checkpoints_dir": str(tmp_path / "ckpt"),
        }
    )
    svc = TinkerService(cfg)
    try:
        sid = svc.create_session({})["session_id"]
        opened = [
            svc.create_sampling_session({"session_id": sid, "base_model": "tiny"})[
                "sampling_session_id"
            ]
            for _ in range(2)
        ]
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
        ask = {"prompt": prompt, "sampling_params": {"max_tokens": 2}, "num_samples": 1}
        rid = svc.asample({**ask, "sampling_session_id": opened[0]})["request_id"]  # now newest
        assert isinstance(svc.futures.retrieve(rid, wait_s=30), bytes)
        third = svc.create_sampling_session({"session_id": sid, "base_model": "tiny"})
        assert list(svc.samplers) == [opened[0], third["sampling_session_id"]]
        with pytest.raises(UserError, match="was closed to free memory"):
            svc.asample({**ask, "sampling_session_id": opened[1]})
    finally:
        svc.close()
