"""TinkerService in-process: sessions whose heartbeats stop are closed and their models freed;
bad ids and names get the errors the HTTP layer maps to the client's shapes."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

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


def test_forward_backward_in_chunks_equals_the_whole_logits() -> None:
    """`train.logit_chunk_tokens: 3` (the output layer 3 positions at a time, recomputed in the
    backward; LoRA on the tied unembedding too) gives the log-probs, losses and gradients of
    the whole micro-batch's logits (`0`) within 1e-6: two rows of unequal length, one
    micro-batch, `importance_sampling` with advantages of both signs."""
    from roll_core.serve.trainer import TrainedModel, lora_targets
    from roll_core.serve.wire import Datum

    g = torch.Generator().manual_seed(0)
    data = []
    for n in (11, 7):
        tokens = torch.randint(3, 300, (n,), generator=g).tolist()
        inputs = {
            "target_tokens": torch.randint(3, 300, (n,), generator=g).numpy(),
            "logprobs": (-torch.rand(n, generator=g) * 3).numpy(),
            "advantages": torch.randn(n, generator=g).numpy(),
        }
        data.append(Datum(tokens=tokens, inputs=inputs))
    results = []
    for chunk in (0, 3):
        cfg = ServeConfig.model_validate(
            {
                "pipeline": "serve",
                "models": [{"name": "tiny", "path": "builtin:tiny-qwen3"}],
                "train": {"device": "cpu", "num_threads": 1, "logit_chunk_tokens": chunk},
            }
        )
        targets = lora_targets(train_attn=True, train_mlp=False, train_unembed=True)
        model = TrainedModel(cfg, cfg.models[0], rank=4, targets=targets, seed=0)
        with torch.no_grad():  # LoRA's B starts at 0: make the adapters count
            for p in model.params:
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        outputs, metrics = model.forward_backward(data, "importance_sampling", {}, backward=True)
        grads = [p.grad.detach().clone() for p in model.params]
        results.append((outputs, metrics, grads))
    (whole, whole_m, whole_g), (chunked, chunked_m, chunked_g) = results
    assert chunked_m["loss:sum"] == pytest.approx(whole_m["loss:sum"], rel=1e-6, abs=1e-6)
    for a, b in zip(whole, chunked, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-6)
    assert any(float(g.abs().max()) > 0 for g in whole_g)
    for a, b in zip(whole_g, chunked_g, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_close_ends_every_thread_even_with_a_connection_kept_alive(service) -> None:
    """A stopped server joins its threads: a daemon thread still inside torch when the
    interpreter exits aborts the process (SIGABRT) instead of exiting 130."""
    import http.client
    import threading

    from roll_core.serve.server import TinkerServer

    before = set(threading.enumerate())
    server = TinkerServer(service, "127.0.0.1", 0)
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/api/v1/healthz")
    assert conn.getresponse().read() == b'{"status": "ok"}'  # the connection stays open
    server.close()
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], left
    assert not service.futures._worker.is_alive()  # the training worker too
    conn.close()


def test_the_vllm_engine_samples_in_the_trainers_precision() -> None:
    from roll_core.serve.service import _engine_dtype

    def cfg(**train: str) -> ServeConfig:
        return ServeConfig.model_validate(
            {
                "pipeline": "serve",
                "models": [{"name": "tiny", "path": "builtin:tiny-qwen3"}],
                "train": {"device": "cpu", **train},
                "sample": {"engine": "vllm"},
            }
        )

    assert _engine_dtype(cfg()) == "float32"
    assert _engine_dtype(cfg(precision="bf16")) == "bfloat16"
    assert _engine_dtype(cfg(precision="auto")) == "float32"  # auto: bf16 on CUDA only
    assert _engine_dtype(cfg(dtype="bfloat16")) == "bfloat16"
