"""The futures protocol of `roll serve`: per-model order, models served in turn, failures in
the client's error shape, cancellation."""

from __future__ import annotations

import threading

from roll_core.errors import CheckpointError
from roll_core.serve.futures import Futures, Result
from roll_core.serve.trainer import UserError


def test_models_take_turns_and_each_keeps_its_order() -> None:
    futures = Futures(sample_threads=1)
    gate, started, order = threading.Event(), threading.Event(), []

    def job(name: str, wait: bool = False):
        def run() -> Result:
            if wait:
                started.set()
                gate.wait(10)
            order.append(name)
            return Result({"name": name})

        return run

    first = futures.submit_train("s1", "A", job("a1", wait=True))
    assert started.wait(10)
    rids = [futures.submit_train("s1", "A", job(n)) for n in ("a2", "a3")]
    rids.append(futures.submit_train("s2", "B", job("b1")))
    assert futures.retrieve(first, wait_s=0.05) is None  # still running: try again
    gate.set()
    assert futures.retrieve(rids[1], wait_s=10) == {"name": "a3"}
    # a1 was running when the rest arrived; then A and B in turn: B's one request is not kept
    # behind A's backlog (first come, first served would give a1, a2, a3, b1)
    assert order == ["a1", "a2", "b1", "a3"]
    futures.close()


def test_failures_answer_the_client_error_shape_and_cancel_works() -> None:
    futures = Futures(sample_threads=1)
    gate = threading.Event()

    def boom() -> Result:
        raise UserError("datum 0 has no input tokens")

    def refused() -> Result:
        raise CheckpointError("adapter does not match.", hint="Use the same rank.")

    def bug() -> Result:
        raise ZeroDivisionError("division by zero")

    def blocked() -> Result:
        gate.wait(10)
        return Result(b"proto")

    rid = futures.submit_train("s", "A", boom)
    assert futures.retrieve(rid, wait_s=10) == {
        "error": "datum 0 has no input tokens",
        "category": "user",
    }
    rid = futures.submit_train("s", "A", refused)
    assert futures.retrieve(rid, wait_s=10) == {
        "error": "adapter does not match. Use the same rank.",
        "category": "user",
    }
    out = futures.retrieve(futures.submit_train("s", "A", bug), wait_s=10)
    assert out == {
        "error": "internal error in roll serve: ZeroDivisionError: division by zero",
        "category": "server",
    }
    running = futures.submit_train("s", "A", blocked)
    queued = futures.submit_train("s", "A", blocked)
    assert futures.cancel(queued) is True
    gate.set()
    assert futures.retrieve(running, wait_s=10) == b"proto"
    assert futures.retrieve(queued, wait_s=10) == {
        "error": f"request {queued} was cancelled",
        "category": "user",
    }
    futures.close()


def test_close_cancels_the_queue_and_join_waits_for_the_running_request() -> None:
    futures = Futures(sample_threads=1)
    gate, started, done = threading.Event(), threading.Event(), []

    def running() -> Result:
        started.set()
        gate.wait(10)
        done.append("running")
        return Result({"ok": True})

    def queued() -> Result:
        done.append("queued")
        return Result({"ok": False})

    first = futures.submit_train("s", "A", running)
    assert started.wait(10)
    later = futures.submit_train("s", "B", queued)
    futures.close()
    # the queued request's client is told at once; it never runs
    assert futures.retrieve(later, wait_s=0.05) == {
        "error": f"request {later} was cancelled",
        "category": "user",
    }
    threading.Timer(0.2, gate.set).start()
    futures.join()  # returns only once the running request is done: no thread is left in it
    assert done == ["running"]
    assert futures.retrieve(first, wait_s=0.05) == {"ok": True}
