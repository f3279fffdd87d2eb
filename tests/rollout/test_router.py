"""The rollout router over fake request-level engines (tests/rollout/fake_engine.py) on a
local-executor cluster: routing by hand-computed loads, affinity, abort, dead ranks, timeouts,
and the deterministic chunk path."""

from __future__ import annotations

import time
from typing import Any

import pytest

from roll_core.backends.infer import Request, SamplingParams
from roll_core.engine import Cluster, LocalExecutor
from roll_core.errors import WorkerDiedError
from roll_core.rollout.router import GenerationTimeout, Router, RouterClosed, estimate_tokens
from tests.rollout.fake_engine import FakeEngine, token


def engines(world: int = 2, **kw: Any) -> Cluster:
    return Cluster("actor_infer", FakeEngine, LocalExecutor(), world_size=world, worker_kwargs=kw)


def req(rid: int, prompt: int = 4, seed: int = 0, prefix: list[int] | None = None) -> Request:
    return Request(rid, list(range(prompt)), seed, prefix_ids=list(prefix or []))


P = SamplingParams(max_new_tokens=8)


def test_least_loaded_by_estimated_tokens() -> None:
    # long requests (0.8 s) so nothing finishes while the routing is checked
    infer = engines(2, token_s=0.1)
    router = Router(infer)
    # estimates: 10 + 8 = 18, 2 + 8 = 10, 3 + 8 = 11
    assert estimate_tokens(req(1, 10), P) == 18
    f1 = router.submit(req(1, 10, seed=7), P)  # loads [0, 0] -> rank 0 (tie: lower rank)
    f2 = router.submit(req(2, 2, seed=7), P)  # loads [18, 0] -> rank 1
    f3 = router.submit(req(3, 3, seed=7), P)  # loads [18, 10] -> rank 1 (10 < 18)
    assert router.load == [18, 21] and router.requests == [1, 2]
    f4 = router.submit(req(4, 1, seed=7), P)  # loads [18, 21] -> rank 0
    assert router.load == [27, 21]
    for f in (f1, f2, f3, f4):
        assert f.result(timeout=10).finish_reason == "length"
    # submissions are asynchronous: a rank may see its two requests in either order
    assert [sorted(ids) for ids in infer.served_ids()] == [[1, 4], [2, 3]]
    assert router.load == [0, 0] and router.requests == [0, 0]
    assert router.stats["requests"] == 4 and router.stats["active_s"] > 0
    router.close()


def test_session_affinity_and_when_it_yields() -> None:
    infer = engines(2, token_s=0.1)
    router = Router(infer, affinity_slack=1.0)
    a = router.submit(req(1, 2, seed=7), P, session="ep")  # rank 0, load [10, 0]
    # same session: rank 0 holds 10 more than rank 1, within 1.0 x its own estimate (10)
    b = router.submit(req(2, 2, seed=7), P, session="ep")
    assert router.load == [20, 0]
    # now 20 more than rank 1 > 10: affinity yields, the session moves to rank 1
    c = router.submit(req(3, 2, seed=7), P, session="ep")
    assert router.load == [20, 10] and router.sessions["ep"] == 1
    d = router.submit(req(4, 2, seed=7), P, session="ep")  # pinned to rank 1 now
    assert router.load == [20, 20]
    for f in (a, b, c, d):
        f.result(timeout=10)
    assert [sorted(ids) for ids in infer.served_ids()] == [[1, 2], [3, 4]]
    router.release("ep")
    assert "ep" not in router.sessions
    router.close()


def test_abort_returns_partials_and_ignores_finished() -> None:
    infer = engines(1, token_s=0.01, lengths={1: 500, 2: 1})
    router = Router(infer)
    done = router.submit(req(2, seed=3), P)
    assert done.result(timeout=10).response_ids == [token(3, 0)]
    slow = router.submit(req(1, seed=3), SamplingParams(max_new_tokens=1000))
    time.sleep(0.1)
    router.abort([1, 2, 99])  # 2 finished, 99 unknown: ignored
    c = slow.result(timeout=10)
    assert c.finish_reason == "abort" and 1 <= len(c.response_ids) < 500
    assert c.response_ids == [token(3, i) for i in range(len(c.response_ids))]
    assert c.log_probs == [-(i + 1) / 100 for i in range(len(c.response_ids))]
    router.close()


def test_an_abort_that_reached_the_engine_before_the_request_is_sent_again() -> None:
    infer = engines(1, token_s=0.01, lengths={1: 500}, start_delay=0.2)
    router = Router(infer)
    start = time.monotonic()
    f = router.submit(req(1, seed=3), SamplingParams(max_new_tokens=1000))
    router.abort([1])  # the engine does not know request 1 yet: ignored there
    c = f.result(timeout=10)
    assert c.finish_reason == "abort"  # the re-sent abort (after 0.5 s) ended it
    assert time.monotonic() - start < 2.5  # not the 5 s the whole response takes
    router.close()


def test_pause_with_abort_holds_new_requests_until_resume() -> None:
    infer = engines(2, token_s=0.01)
    router = Router(infer)
    long = SamplingParams(max_new_tokens=1000)
    running = [router.submit(req(i, seed=999), long) for i in (1, 2)]
    time.sleep(0.03)
    router.pause(abort=True)  # returns once both partials are back
    assert all(f.done() and f.result().finish_reason == "abort" for f in running)
    held = router.submit(req(3, seed=2), P)
    time.sleep(0.05)
    assert not held.done() and router.in_flight() == 0
    router.resume()
    assert held.result(timeout=10).response_ids == [token(2, i) for i in range(3)]
    router.close()


def test_a_dead_rank_fails_its_requests_by_name_and_the_rest_carry_on() -> None:
    infer = engines(2, token_s=0.02, die=(3,))
    router = Router(infer)
    first = router.submit(req(1, seed=7), P)  # rank 0
    second = router.submit(req(2, seed=7), P)  # rank 1
    killer = router.submit(req(3, seed=7), P)  # rank 0 (tie at 12 each) -> dies
    with pytest.raises(WorkerDiedError, match="actor_infer rank 0 died"):
        killer.result(timeout=10)
    with pytest.raises(WorkerDiedError, match="actor_infer rank 0 died"):
        first.result(timeout=10)  # held by the dead rank: failed with it, no hang
    assert second.result(timeout=10).finish_reason == "length"
    after = router.submit(req(4, seed=7), P)
    assert after.result(timeout=10).finish_reason == "length"  # routed to rank 1
    assert 4 in infer.served_ids()[1] and router.dead.keys() == {0}
    router.close()


def test_every_rank_dead_fails_new_requests_at_once() -> None:
    infer = engines(1, token_s=0.001, die=(1,))
    router = Router(infer)
    with pytest.raises(WorkerDiedError):
        router.submit(req(1), P).result(timeout=10)
    with pytest.raises(WorkerDiedError, match="rank 0"):
        router.submit(req(2), P).result(timeout=1)


def test_a_request_past_the_timeout_fails_naming_the_rank() -> None:
    infer = engines(2, token_s=0.01, hang=(2,))
    router = Router(infer, request_timeout_s=0.3)
    ok = router.submit(req(1, seed=1), P)
    stuck = router.submit(req(2, seed=1), P)  # rank 1, never finishes
    start = time.monotonic()
    with pytest.raises(GenerationTimeout, match="rank 1 did not answer a request"):
        stuck.result(timeout=10)
    assert time.monotonic() - start < 3
    assert ok.result(timeout=10).finish_reason == "stop"
    assert router.load == [0, 0]
    router.close()


def test_close_fails_waiting_requests() -> None:
    infer = engines(1, token_s=0.01)
    router = Router(infer)
    router.pause()
    f = router.submit(req(1), P)
    router.close()
    with pytest.raises(RouterClosed):
        f.result(timeout=1)


def test_deterministic_chunks_keep_membership_order_and_slots() -> None:
    infer = engines(2, token_s=0.01)
    router = Router(infer, deterministic=True, chunk_size=3, max_chunks_in_flight=1)
    a = router.submit_batch([req(i, seed=5) for i in (1, 2, 3, 4)], P)  # one fixed chunk
    # single requests: 5 finds rank 1's slot free and goes alone; 6, 7, 8 wait for a slot and
    # go together (consecutive, same params, at most chunk_size)
    singles = [router.submit(req(i, seed=5), P) for i in (5, 6, 7, 8)]
    for f in a + singles:
        assert f.result(timeout=10).response_ids == [token(5, i) for i in range(6)]
    batches = sorted(b for rank in infer.batch_ids() for b in rank)
    assert batches == [[1, 2, 3, 4], [5], [6, 7, 8]]
    assert router.chunks == [0, 0] and router.stats["calls"] == 3
    router.close()
