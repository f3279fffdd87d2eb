"""RewardRouter: routing by domain, failures and timeouts counted, threads, metrics."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from roll_core.config.reward import DomainRewardConfig, RewardConfig
from roll_core.errors import ConfigError
from roll_core.rewards import (
    DomainStats,
    RewardResult,
    RewardRouter,
    RewardSample,
    domain_metrics,
)

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def process_router():
    """One process-isolated router (2 workers) shared by this module's process tests:
    each worker start imports math-verify (about 0.5 s of CPU), so they are started once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        hang = DomainRewardConfig.model_validate(
            {"rewards": ["reward_fns_for_tests:hang"], "timeout_s": 0.5}
        )
        domains = {
            "math": "math",
            "hang": hang,
            "die": "reward_fns_for_tests:dies",
            "boom": "reward_fns_for_tests:boom",
            "text": "reward_fns_for_tests:returns_text",
            "kw": "reward_fns_for_tests:keyword",
        }
        with RewardRouter(domains, isolation="process", num_workers=2) as router:
            yield router


@pytest.fixture
def fresh(process_router):
    """The shared process router with an empty metrics window."""
    process_router.metrics()
    return process_router


def math_row(response: str, answer: str = "68") -> RewardSample:
    return RewardSample("q", response, {"answer": answer, "domain": "math"}, 3, "stop")


def row(domain: str | None, response: str) -> RewardSample:
    return RewardSample("q", response, {"domain": domain})


def test_routes_by_domain_with_defaults(user_fns) -> None:
    cfg = RewardConfig.model_validate(
        {
            "domains": {"math": {}, "len": "reward_fns_for_tests:length_score"},
            "isolation": "thread",
        }
    )
    with RewardRouter.from_config(cfg, dataset_domains=["math", "len"]) as router:
        right = router.score(math_row("The answer is 68."))
        assert right.score == 1.0
        assert right.info["correct"] is True and right.info["error"] is None
        assert router.score(row("len", "abcd")).score == pytest.approx(0.4)  # 4 chars / 10
        m = router.metrics()
    assert m["reward/math/mean"] == 1.0 and m["reward/math/accuracy"] == 1.0
    assert m["reward/len/mean"] == pytest.approx(0.4)
    assert "reward/len/accuracy" not in m  # length_score reports no `correct`
    assert m["reward/unknown_domain/count"] == 0.0


def test_unknown_domain_is_a_start_up_error_when_data_is_known() -> None:
    with pytest.raises(ConfigError, match=r"domain\(s\) 'code' with no reward; configured"):
        RewardRouter({"math": "math"}, dataset_domains=["math", "code"], isolation="thread")
    with pytest.raises(ConfigError, match="default_domain is not set"):
        RewardRouter({"math": "math"}, dataset_domains=["math", None], isolation="thread")
    with pytest.raises(ConfigError, match="no reward domains"):
        RewardRouter({}, isolation="thread")


def test_unknown_domain_at_run_time_is_counted() -> None:
    with RewardRouter({"math": "math"}, isolation="thread") as router:
        r = router.score(row("code", "print(1)"))
        assert r.score == 0.0
        assert r.info["unknown_domain"] is True and "'code'" in r.info["error"]
        assert router.score(row(None, "x")).info["unknown_domain"] is True
        assert router.metrics()["reward/unknown_domain/count"] == 2.0
        assert router.unknown_total == 2


def test_default_domain_scores_rows_without_one() -> None:
    with RewardRouter({"math": "math"}, default_domain="math", isolation="thread") as router:
        router.check_domains([None, "math"])  # fine: rows without a domain go to math
        r = router.score(RewardSample("q", "68", {"answer": "68"}))
    assert r.score == 1.0


@pytest.fixture(params=["thread", "process"])
def any_router(request, user_fns):
    """A thread-isolated router, then the shared process-isolated one."""
    if request.param == "process":
        yield request.getfixturevalue("fresh")
        return
    domains = {
        "boom": "reward_fns_for_tests:boom",
        "text": "reward_fns_for_tests:returns_text",
        "math": "math",
        "kw": "reward_fns_for_tests:keyword",
    }
    with RewardRouter(domains, isolation="thread") as router:
        yield router


def test_raising_and_bad_functions_score_zero_and_are_counted(any_router) -> None:
    router = any_router
    failed = router.score(row("boom", "boom!"))
    assert failed.score == 0.0
    assert failed.info == {"error": "ZeroDivisionError: boom in the response", "timeout": False}
    assert router.score(row("boom", "fine")).score == 0.5  # the run goes on
    assert "return a float or a RewardResult" in router.score(row("text", "x")).info["error"]
    # a math row without a reference answer is an error of that sample, not of the run
    no_ref = router.score(RewardSample("q", "68", {"domain": "math"}))
    assert "no reference answer" in no_ref.info["error"]
    m = router.metrics()
    # boom: scores 0.0 (error) and 0.5 -> mean 0.25, 1 error
    assert m["reward/boom/mean"] == pytest.approx(0.25)
    assert (m["reward/boom/errors"], m["reward/boom/timeouts"], m["reward/text/errors"]) == (
        1.0,
        0.0,
        1.0,
    )
    assert m["reward/math/errors"] == 1.0 and "reward/math/accuracy" not in m


def test_hanging_function_is_killed_in_process_isolation(fresh) -> None:
    router = fresh
    replaced = router.runner.replaced
    assert router.score(math_row("68")).score == 1.0  # a worker is up
    start = time.perf_counter()
    r = router.score(row("hang", "x"))
    elapsed = time.perf_counter() - start
    assert r.score == 0.0
    assert r.info == {"error": "timed out after 0.5 s", "timeout": True}
    assert 0.5 <= elapsed < 3.0  # the 0.5 s bound, plus the kill
    # the worker was killed and replaced: the next samples are scored normally
    assert [router.score(math_row("68")).score for _ in range(3)] == [1.0, 1.0, 1.0]
    assert router.runner.replaced == replaced + 1
    m = router.metrics()
    assert (m["reward/hang/timeouts"], m["reward/hang/errors"], m["reward/hang/mean"]) == (
        1.0,
        0.0,
        0.0,
    )


def test_hanging_function_is_abandoned_in_thread_isolation(user_fns) -> None:
    with RewardRouter(
        {"hang": "reward_fns_for_tests:hang"}, isolation="thread", timeouts={"hang": 0.2}
    ) as router:
        r = router.score(row("hang", "x"))
        assert r.info["timeout"] is True and r.score == 0.0
        assert router.runner.stuck() == 1  # still running in the background
        user_fns.RELEASE.set()
        deadline = time.monotonic() + 5
        while router.runner.stuck() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert router.runner.stuck() == 0
        assert router.totals()["hang"].timeouts == 1


def test_worker_crash_is_an_error_and_the_worker_is_replaced(fresh) -> None:
    router = fresh
    r = router.score(row("die", "x"))
    assert r.info["error"] == "the reward worker died (exit code 3)"
    assert [router.score(math_row("68")).score for _ in range(3)] == [1.0, 1.0, 1.0]
    assert router.metrics()["reward/die/errors"] == 1.0


def test_unpicklable_function_needs_thread_isolation() -> None:
    offset = 0.25
    with pytest.raises(ConfigError, match="reward.isolation: thread"):
        RewardRouter({"c": lambda sample: offset})
    with RewardRouter({"c": lambda sample: offset}, isolation="thread") as router:
        assert router.score(row("c", "x")).score == 0.25


def test_thread_safety_smoke(any_router) -> None:
    """8 threads score 12 samples each at once; every result and every counter is right."""
    router = any_router
    results: dict[tuple[int, int], RewardResult] = {}
    barrier = threading.Barrier(8)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(12):
            if i % 3 == 2:  # every third sample: the keyword domain, "yes" when t is even
                s = row("kw", "yes" if t % 2 == 0 else "no")
            else:  # math: the right answer when i is even
                s = math_row(f"The answer is {t + i if i % 2 else 68}.", "68")
            results[t, i] = router.score(s)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    m = router.metrics()
    for (t, i), r in results.items():
        if i % 3 == 2:
            assert r.score == (1.0 if t % 2 == 0 else 0.0)
        else:
            # odd i: t + i == 68 never happens for t < 8, i < 12
            assert r.score == (1.0 if i % 2 == 0 else 0.0), (t, i, r)
    assert len(results) == 96
    # per thread: i in 0..11 -> kw at i = 2, 5, 8, 11 (4), math at the other 8,
    # of which i = 0, 4, 6, 10 are even (right): 8 threads * 8 = 64 math, 32 right
    assert m["reward/math/count"] == 64.0 and m["reward/math/accuracy"] == 0.5
    # kw: 8 threads * 4 = 32 samples, the 4 even threads say "yes": 16 right
    assert m["reward/kw/count"] == 32.0 and m["reward/kw/mean"] == 0.5
    assert m["reward/math/errors"] == m["reward/math/timeouts"] == 0.0


def test_metrics_window_totals_and_state() -> None:
    with RewardRouter({"math": "math"}, isolation="thread") as router:
        for response in ["68", "67", "no answer"]:
            router.score(math_row(response))
        first = router.metrics()
        router.score(math_row("68"))
        second = router.metrics(reset=False)
        assert router.metrics()["reward/math/count"] == 1.0  # reset=False kept the window
        state = router.state_dict()
    # window 1: scores 1, 0, 0 -> mean 1/3, accuracy 1/3 (a missing answer is graded wrong)
    assert first["reward/math/mean"] == pytest.approx(1 / 3)
    assert first["reward/math/accuracy"] == pytest.approx(1 / 3)
    assert second["reward/math/count"] == 1.0 and second["reward/math/mean"] == 1.0
    assert state["totals"]["math"]["count"] == 4 and state["totals"]["math"]["correct"] == 2
    with RewardRouter({"math": "math"}, isolation="thread") as restored:
        restored.load_state_dict(state)
        assert restored.totals()["math"].count == 4
        assert restored.metrics()["reward/math/count"] == 0.0  # windows start empty


def test_domain_metrics_of_a_batch() -> None:
    ok = RewardResult(1.0, {"correct": True, "error": None, "timeout": False})
    wrong = RewardResult(0.0, {"correct": False, "error": None, "timeout": False})
    err = RewardResult(0.0, {"error": "ValueError: x", "timeout": False})
    late = RewardResult(0.0, {"error": "timed out after 5 s", "timeout": True})
    fmt = RewardResult(0.5, {"format_ok": True})
    m = domain_metrics(
        ["math", "math", "math", "math", "math", "fmt", None],
        [ok, ok, wrong, err, late, fmt, wrong],
    )
    # math: scores 1 + 1 + 0 + 0 + 0 = 2 over 5 -> mean 0.4; graded 3 (2 right) plus
    # 1 error and 1 timeout counted wrong -> accuracy 2 / 5 = 0.4
    assert m["reward/math/mean"] == pytest.approx(0.4)
    assert m["reward/math/accuracy"] == pytest.approx(0.4)
    assert (m["reward/math/errors"], m["reward/math/timeouts"]) == (1.0, 1.0)
    assert m["reward/fmt/mean"] == 0.5 and "reward/fmt/accuracy" not in m
    assert m["reward/unknown_domain/count"] == 1.0
    with pytest.raises(ValueError, match="2 domains for 1 results"):
        domain_metrics(["a", "b"], [ok])
    assert DomainStats().metrics("x") == {
        "reward/x/count": 0.0,
        "reward/x/errors": 0.0,
        "reward/x/timeouts": 0.0,
    }


def test_worker_start_up_is_not_part_of_the_timeout(tmp_path: Path, monkeypatch) -> None:
    """A user module that takes 0.8 s to import still meets a 0.5 s per-sample timeout:
    workers import (and warm up) their functions before they take samples."""
    (tmp_path / "slow_import_reward.py").write_text(
        "import time\ntime.sleep(0.8)\n\ndef score(sample):\n    return 0.75\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    slow = DomainRewardConfig.model_validate(
        {"rewards": ["slow_import_reward:score"], "timeout_s": 0.5}
    )
    with RewardRouter({"slow": slow}, num_workers=1) as router:
        r = router.score(row("slow", "x"))
    assert (r.score, r.info["timeout"], r.info["error"]) == (0.75, False, None)


def test_functions_from_main_need_thread_isolation() -> None:
    def scripted(sample: RewardSample) -> float:
        return 1.0

    scripted.__module__ = "__main__"  # as if defined in a script run with `python script.py`
    with pytest.raises(ConfigError, match=r"defined in the script being run \(__main__\)"):
        RewardRouter({"s": scripted})


def test_workers_that_cannot_start_stop_being_restarted(tmp_path: Path, monkeypatch) -> None:
    """A function the workers cannot import fails every sample with the reason, and after
    3 failed starts in a row no more processes are started."""
    module = tmp_path / "vanishing_reward.py"
    module.write_text("def score(sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardRouter({"v": "vanishing_reward:score"}, num_workers=1) as router:
        module.unlink()  # importable when the router checked it, gone for the workers
        errors = [router.score(row("v", "x")).info["error"] for _ in range(4)]
        assert router.runner.replaced == 3
    assert all("cannot import module 'vanishing_reward'" in e for e in errors), errors
    assert errors[3].endswith("(3 workers in a row; gave up)")
    assert router.totals()["v"].errors == 4


def test_thread_isolation_reuses_its_threads_but_never_a_stuck_one() -> None:
    from roll_core.rewards.execution import ThreadRunner

    release = threading.Event()
    runner = ThreadRunner({"ok": lambda s: 1.0, "hang": lambda s: float(release.wait(30))})

    def threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("roll-reward-")]

    before = len(threads())
    try:
        assert [runner.run("ok", None, 5).result.score for _ in range(20)] == [1.0] * 20
        assert len(threads()) == before + 1  # one thread served all 20 calls
        stuck = runner.run("hang", None, 0.1)
        assert stuck.timed_out and runner.stuck() == 1
        # the next call does not queue behind the stuck one: it gets a thread of its own
        assert runner.run("ok", None, 5).result.score == 1.0
        release.set()
        deadline = time.monotonic() + 5
        while runner.stuck() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.stuck() == 0  # the abandoned thread ended after its call
    finally:
        release.set()
        runner.close()
