"""The `vllm` backend's request-level mode (``serving="request"``: vLLM's AsyncLLM on the
rank's own event loop) against its fixed-batch mode (``serving="batch"``: ``vllm.LLM``) on
vLLM's CPU build: the same tokens and behaviour log-probs, requests answered as they finish,
abort with partial responses, pause/resume, weight sync, many threads through ActorInfer,
and an engine that dies.

Engine starts are slow on 2 cores (~30 s each): the session's batch engine
(tests/backends/conftest.py, shared with test_vllm_engine_batch.py) gives the reference
outputs; the session's request-mode engine (a real ActorInfer on a local Cluster, shared with
test_vllm.py) serves every other test; the death test starts its own."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from roll_core.backends.infer import Request, SamplingParams, make_infer_backend
from roll_core.errors import ConfigError
from roll_core.models import load_causal_lm

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed (pip install -c constraints-cpu.txt 'roll[cpu]')"
)
PROMPT = [257, *b"What is 12 + 35?", 258, 257, *b"assistant\n"]  # ids of the byte tokenizer
OTHER = [257, *b"Name a colour.", 258, 257, *b"assistant\n"]
LONG = 400  # greedy on the tiny model repeats one token and never stops: a long request
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.7)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
# the death test's own engine: the options of the shared engines (tests/backends/conftest.py)
OPTS = dict(num_threads=1, dtype="float32", sync_bucket_mb=1, cpu_kv_cache_gb=0.25)


def sampled_requests() -> list[Request]:
    return [
        Request(request_id=i, prompt_ids=list(PROMPT if i % 2 else OTHER), seed=100 + i)
        for i in range(6)
    ]


def greedy_requests() -> list[Request]:
    return [
        Request(request_id=20 + i, prompt_ids=list(p), seed=0)
        for i, p in enumerate((PROMPT, OTHER))
    ]


def long_request(request_id: int, prefix: list[int] | None = None) -> Request:
    return Request(request_id=request_id, prompt_ids=list(PROMPT), seed=0, prefix_ids=prefix or [])


def long_params(n: int = LONG) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


# ---- no engine -----------------------------------------------------------------------------
def test_an_unknown_serving_mode_is_refused_before_any_engine() -> None:
    with pytest.raises(ConfigError, match="unknown serving mode 'stream'") as err:
        make_infer_backend("vllm", model_path="unused", serving="stream")
    assert "request, batch" in err.value.message and "vllm.LLM" in (err.value.hint or "")


@needs_vllm
def test_request_mode_checks_the_head_size_the_engine_derived(tmp_path, monkeypatch) -> None:
    """The CPU head-size check after start-up holds in request mode too; the engine (here a
    stand-in for the AsyncLLM runner) is closed."""
    import types

    import roll_core.backends.infer.vllm_backend as vb

    closed: list[bool] = []

    class FakeEngine(vb.AsyncEngine):
        def __init__(self) -> None:  # no loop, no AsyncLLM
            self.model_config = types.SimpleNamespace(get_head_size=lambda: 16)

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(vb, "_start_async_engine", lambda settings, model_path: FakeEngine())
    monkeypatch.setattr(
        "vllm.platforms.current_platform", types.SimpleNamespace(is_cpu=lambda: True)
    )
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="head size vLLM derived from the model's config: 16"):
        vb.VLLMInferBackend(model_path=str(tmp_path), serving="request")
    assert closed == [True]


# ---- the event-loop bridge on a stand-in engine (milliseconds, no vLLM process) -------------
class FakeAsyncLLM:
    """The part of AsyncLLM's API that vllm_async.AsyncEngine uses: `generate` streams what
    the test `emit`s (delta outputs), `abort` ends a request with finish reason abort."""

    def __init__(self) -> None:
        import asyncio

        self.model_config = None
        self.errored = False
        self.streams: dict[str, asyncio.Queue] = {}
        self.aborted: list[str] = []
        self.loop = asyncio.get_running_loop()

    @staticmethod
    def output(tokens: list[int], finish: str | None) -> object:
        import types

        logps = [{t: types.SimpleNamespace(logprob=-0.5 * t)} for t in tokens]
        done = types.SimpleNamespace(token_ids=tokens, logprobs=logps, finish_reason=finish)
        return types.SimpleNamespace(outputs=[done], prompt_logprobs=None)

    async def generate(self, prompt, sampling, request_id: str, lora_request=None):
        import asyncio

        queue = self.streams.setdefault(request_id, asyncio.Queue())
        while True:
            out = await queue.get()
            yield out
            if out.outputs[0].finish_reason is not None:
                return

    def emit(self, request_id: str, tokens: list[int], finish: str | None = None) -> None:
        import asyncio

        def put() -> None:
            self.streams.setdefault(request_id, asyncio.Queue()).put_nowait(
                self.output(tokens, finish)
            )

        self.loop.call_soon_threadsafe(put)

    async def abort(self, request_ids) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.aborted.append(rid)
            self.streams[rid].put_nowait(self.output([], "abort"))

    def shutdown(self) -> None:
        pass


@pytest.fixture
def bridge(monkeypatch):
    from roll_core.backends.infer import vllm_async

    async def start(self, engine_args):
        return FakeAsyncLLM()

    monkeypatch.setattr(vllm_async.AsyncEngine, "_start", start)
    monkeypatch.setattr(vllm_async, "_POLL_S", 0.05)
    engine = vllm_async.AsyncEngine(None, name="the test engine")
    yield engine
    engine.close()


def _sampling():
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(max_tokens=8)


def _wait_for_stream(engine, vllm_id: str) -> None:
    deadline = time.time() + 5
    while vllm_id not in engine.engine.streams:
        assert time.time() < deadline
        time.sleep(0.01)


@needs_vllm
def test_the_bridge_accumulates_deltas_and_aborts_with_the_tokens_so_far(bridge) -> None:
    first = bridge.submit(7, None, _sampling())
    second = bridge.submit(7, None, _sampling())  # the same roll id again: its own vLLM id
    _wait_for_stream(bridge, "roll-7-0")
    _wait_for_stream(bridge, "roll-7-1")
    bridge.engine.emit("roll-7-0", [3, 4])
    bridge.engine.emit("roll-7-0", [5], "length")
    done = bridge.wait(first)
    assert (done.token_ids, done.log_probs, done.finish_reason) == (
        [3, 4, 5],
        [-1.5, -2.0, -2.5],
        "length",
    )
    bridge.engine.emit("roll-7-1", [9])
    time.sleep(0.05)
    bridge.abort([7, 12345])  # 12345: not in flight, ignored
    part = bridge.wait(second)
    assert (part.token_ids, part.log_probs, part.finish_reason) == ([9], [-4.5], "abort")
    assert bridge.engine.aborted == ["roll-7-1"]  # the finished request was not aborted
    bridge.abort([7])  # nothing in flight any more: a no-op
    assert bridge.engine.aborted == ["roll-7-1"]


@needs_vllm
def test_the_bridge_fails_waiting_calls_when_the_engine_dies_or_closes(bridge) -> None:
    from roll_core.backends.infer.vllm_async import EngineDiedError

    waiting = bridge.submit(1, None, _sampling())
    _wait_for_stream(bridge, "roll-1-0")
    bridge.engine.errored = True  # what AsyncLLM reports once its engine process is gone
    with pytest.raises(EngineDiedError, match="the test engine died: its engine-core process"):
        bridge.wait(waiting)
    bridge.engine.errored = False
    other = bridge.submit(2, None, _sampling())
    _wait_for_stream(bridge, "roll-2-1")
    closer = threading.Timer(0.1, bridge.close)
    closer.start()
    with pytest.raises(RuntimeError, match="the test engine was closed while this call waited"):
        bridge.wait(other)
    closer.join()
    with pytest.raises(RuntimeError, match="the test engine is closed"):
        bridge.submit(3, None, _sampling())


# ---- the session's batch engine for the reference, its request engine for the rest ---------
@pytest.fixture(scope="module")
def model_dir(vllm_model_dir: str) -> str:
    return vllm_model_dir


@pytest.fixture(scope="module")
def reference(vllm_batch) -> dict:
    """Today's path (`vllm.LLM`, whole lists): the outputs request mode must reproduce."""
    # the fixed-batch mode answers lists only, and says so
    with pytest.raises(ConfigError, match="built with serving='batch'"):
        vllm_batch.generate_request(sampled_requests()[0], SAMPLED)
    return {
        "sampled": vllm_batch.generate(sampled_requests(), SAMPLED),
        "greedy": vllm_batch.generate(greedy_requests(), GREEDY),
        "long": vllm_batch.generate([long_request(0)], long_params())[0],
    }


@pytest.fixture(scope="module")
def infer(vllm_request, reference: dict):
    """A real ActorInfer rank on a local Cluster; its backend serves the module."""
    return vllm_request


@pytest.fixture(scope="module")
def engine(infer):
    backend = infer.handles[0].worker.backend
    assert backend.serving == "request"  # the default
    return backend


@pytest.fixture(scope="module")
def hf(model_dir: str):
    return load_causal_lm(model_dir, dtype=torch.float32, device=torch.device("cpu")).eval()


def recompute(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token, by transformers (the trainer's view)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def wait_all(futures: list[Future], timeout: float = 120) -> list:
    return [f.result(timeout=timeout) for f in futures]


@pytest.mark.slow
@needs_vllm
def test_greedy_equals_batch_mode_token_for_token(infer, reference) -> None:
    futures = [infer.at(0).generate_request(r, GREEDY) for r in greedy_requests()]
    for got, want in zip(wait_all(futures), reference["greedy"], strict=True):
        assert got.request_id == want.request_id
        assert got.response_ids == want.response_ids and got.finish_reason == want.finish_reason
        assert gap(got.log_probs, want.log_probs) < 1e-5
    assert reference["long"].finish_reason == "length"  # what the long-request tests rely on
    assert len(reference["long"].response_ids) == LONG


@pytest.mark.slow
@needs_vllm
def test_many_threads_through_actor_infer_get_todays_tokens_and_log_probs(
    infer, reference, hf
) -> None:
    """Six threads each send one seeded request to rank 0 at once: each gets the tokens the
    batch path sampled for it, with the same behaviour log-probs, which a trainer-style
    forward reproduces (the tolerance of tests/backends/test_vllm.py)."""
    results: dict[int, object] = {}

    def client(req: Request) -> None:
        results[req.request_id] = infer.at(0).generate_request(req, SAMPLED).result(timeout=120)

    threads = [threading.Thread(target=client, args=(r,)) for r in sampled_requests()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert sorted(results) == list(range(6))
    for want, req in zip(reference["sampled"], sampled_requests(), strict=True):
        got = results[req.request_id]
        assert got.response_ids == want.response_ids, req.request_id
        assert got.finish_reason == want.finish_reason
        assert gap(got.log_probs, want.log_probs) < 1e-5
        trainer = recompute(hf, req.prompt_ids, got.response_ids, 0.7).tolist()
        assert gap(got.log_probs, trainer) < 1e-4
        assert got.policy_version == 0 and got.timing["gen_end"] >= got.timing["gen_start"]
    assert len({tuple(results[i].response_ids) for i in results}) > 1  # seeds differ


@pytest.mark.slow
@needs_vllm
def test_a_seeded_request_alone_equals_the_same_among_others(engine, reference) -> None:
    alone = engine.generate_request(sampled_requests()[3], SAMPLED)
    assert alone.response_ids == reference["sampled"][3].response_ids
    # generate(list) in request mode (evaluation uses it): submitted at once, gathered
    listed = engine.generate(sampled_requests(), SAMPLED)
    assert [c.request_id for c in listed] == list(range(6))
    assert [c.response_ids for c in listed] == [c.response_ids for c in reference["sampled"]]


@pytest.mark.slow
@needs_vllm
def test_a_short_request_sent_after_a_long_one_returns_first(infer, reference) -> None:
    long = infer.at(0).generate_request(long_request(30), long_params())
    time.sleep(0.2)
    short = infer.at(0).generate_request(sampled_requests()[1], SAMPLED)
    first = short.result(timeout=120)
    assert not long.done()  # still decoding: the short one did not wait for it
    done = long.result(timeout=120)
    assert first.timing["gen_end"] < done.timing["gen_end"]
    assert first.response_ids == reference["sampled"][1].response_ids
    assert done.response_ids == reference["long"].response_ids


@pytest.mark.slow
@needs_vllm
def test_abort_returns_the_partial_response_and_the_others_continue(infer, reference) -> None:
    full = reference["long"]
    doomed = infer.at(0).generate_request(long_request(40), long_params())
    other = infer.at(0).generate_request(long_request(41), long_params())
    # a short request sent after both: when it is done the engine has run >= 12 steps with
    # the long ones in the batch, so the aborted one has tokens to return
    engine_steps = infer.at(0).generate_request(sampled_requests()[0], SAMPLED)
    engine_steps.result(timeout=120)
    infer.abort_requests([40, 999])  # 999: not in flight, ignored
    part = doomed.result(timeout=60)
    assert part.finish_reason == "abort" and part.request_id == 40
    n = len(part.response_ids)
    assert 12 <= n < LONG
    assert part.response_ids == full.response_ids[:n]  # the tokens so far, exactly
    assert gap(part.log_probs, full.log_probs[:n]) < 1e-5
    rest = other.result(timeout=120)  # the other request was not touched
    assert rest.finish_reason == "length" and rest.response_ids == full.response_ids
    infer.abort_requests([40, 41])  # finished: ignored
    # partial rollout: the same request id again, continued from its prefix under a new
    # vLLM request id, gives exactly the rest of the response
    cont = infer.at(0).generate_request(
        long_request(40, prefix=part.response_ids), long_params(LONG - n)
    )
    tail = cont.result(timeout=120)
    assert tail.finish_reason == "length"
    assert part.response_ids + tail.response_ids == full.response_ids
    assert gap(tail.log_probs, full.log_probs[n:]) < 1e-4


@pytest.mark.slow
@needs_vllm
def test_pause_then_resume_keeps_progress(infer, reference) -> None:
    kept = infer.at(0).generate_request(long_request(50), long_params())
    infer.at(0).generate_request(sampled_requests()[2], SAMPLED).result(timeout=120)
    infer.pause_generation()
    try:
        queued = infer.at(0).generate_request(sampled_requests()[4], SAMPLED)
        time.sleep(1.5)  # ~250 steps' worth of time: nothing may move while paused
        assert not kept.done() and not queued.done()
    finally:
        infer.resume_generation()
    assert queued.result(timeout=120).response_ids == reference["sampled"][4].response_ids
    done = kept.result(timeout=120)
    # the in-flight request went on from where it was: the full response, once
    assert done.finish_reason == "length" and done.response_ids == reference["long"].response_ids
    assert gap(done.log_probs, reference["long"].log_probs) < 1e-5


@pytest.mark.slow
@needs_vllm
def test_an_abort_while_paused_returns_at_once(infer, reference) -> None:
    """Partial rollout's order at a sync: pause, abort what is in flight (it returns its
    tokens so far without an engine step), sync, resume."""
    full = reference["long"]
    doomed = infer.at(0).generate_request(long_request(55), long_params())
    infer.at(0).generate_request(sampled_requests()[2], SAMPLED).result(timeout=120)
    infer.pause_generation()
    try:
        infer.abort_requests([55])
        part = doomed.result(timeout=30)
    finally:
        infer.resume_generation()
    n = len(part.response_ids)
    assert part.finish_reason == "abort" and 12 <= n < LONG
    assert part.response_ids == full.response_ids[:n]


@pytest.mark.slow
@needs_vllm
def test_a_weight_sync_in_request_mode_changes_what_is_served(infer, engine, hf, reference) -> None:
    """pause -> update_weights -> resume through ActorInfer, with a request in flight: the
    served weights change (checksum, log-probs explained by the new weights only), new
    requests carry the new version, the request in flight finishes."""
    original = {n: p.detach().clone() for n, p in hf.named_parameters()}
    g = torch.Generator().manual_seed(3)
    weights = {n: p + torch.randn(p.shape, generator=g) * 0.02 for n, p in original.items()}
    before = engine.weight_checksum()
    in_flight = infer.at(0).generate_request(long_request(60), long_params())
    try:
        infer.pause_generation()
        try:
            infer.update_weights(weights, version=5)
        finally:
            infer.resume_generation()
        expected = sum(float(p.double().sum()) for p in weights.values())
        assert engine.weight_checksum() == pytest.approx(expected, rel=1e-9) != before
        crossed = in_flight.result(timeout=120)
        assert crossed.finish_reason in ("stop", "length") and crossed.policy_version == 0
        req = sampled_requests()[5]
        after = infer.at(0).generate_request(req, SAMPLED).result(timeout=120)
        assert after.policy_version == 5
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.copy_(weights[n])
        assert (
            gap(after.log_probs, recompute(hf, req.prompt_ids, after.response_ids, 0.7).tolist())
            < 1e-4
        )
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.copy_(original[n])
        old = recompute(hf, req.prompt_ids, after.response_ids, 0.7).tolist()
        assert gap(after.log_probs, old) > 1e-2
    finally:
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.copy_(original[n])
        infer.update_weights(original, version=0)
    # and back: the original weights serve the original tokens
    back = infer.at(0).generate_request(sampled_requests()[5], SAMPLED).result(timeout=120)
    assert back.response_ids == reference["sampled"][5].response_ids


@pytest.mark.slow
@needs_vllm
def test_a_killed_engine_fails_every_waiting_request(model_dir: str) -> None:
    """SIGKILL the engine-core process while three requests wait: each call fails with an
    error naming the engine (no hang), so does the next one, and close() returns."""
    from roll_core.backends.infer.vllm_async import EngineDiedError

    backend = make_infer_backend("vllm", model_path=model_dir, **OPTS)
    try:
        pids = backend.llm.engine_pids()
        loop_thread = backend.llm._thread
        assert pids and loop_thread.is_alive()
        errors: list[BaseException] = []

        def client(i: int) -> None:
            try:
                backend.generate_request(long_request(70 + i), long_params())
            except BaseException as err:  # noqa: BLE001 - collected for the asserts
                errors.append(err)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        # kill while all three are mid-generation (a fixed sleep let a fast machine finish them)
        deadline = time.time() + 30
        while time.time() < deadline:
            with backend.llm._lock:
                parts = [p for ps in backend.llm._inflight.values() for p in ps]
            if len(parts) == 3 and all(p.token_ids and p.finish_reason is None for p in parts):
                break
            time.sleep(0.005)
        else:
            pytest.fail("three requests never were in flight together")
        os.kill(pids[0], signal.SIGKILL)
        start = time.time()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a waiting request hung"
        print(f"engine killed: the waiting calls failed after {time.time() - start:.2f} s")
        assert len(errors) == 3 and all(isinstance(e, EngineDiedError) for e in errors), errors
        assert f"engine-core pid {pids[0]}" in str(errors[0]) and model_dir in str(errors[0])
        with pytest.raises(EngineDiedError):
            backend.generate_request(long_request(80), long_params(4))
    finally:
        backend.close()  # type: ignore[attr-defined]
    assert not loop_thread.is_alive()  # close() stopped the engine's event loop


@pytest.mark.slow
@needs_vllm
def test_top_logprobs_are_the_models_most_likely_tokens(engine, vllm_batch, hf) -> None:
    """``SamplingParams.top_logprobs`` through vLLM (request and batch modes): at each generated
    position the k most likely ids with log softmax(logits / T), as a transformers forward
    gives them (the trainer's view), most likely first."""
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_logprobs=3)
    req = sampled_requests()[1]
    for out in (engine.generate_request(req, params), vllm_batch.generate([req], params)[0]):
        assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.response_ids)
        ids = torch.tensor([req.prompt_ids + out.response_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(req.prompt_ids) - 1 : -1].float() / 0.7
        logps = torch.log_softmax(logits, -1)
        for t, top in enumerate(out.top_logprobs):
            want = torch.topk(logps[t], 3)
            assert [i for i, _ in top] == want.indices.tolist()
            assert gap([v for _, v in top], want.values.tolist()) < 1e-4
    assert engine.generate_request(req, SAMPLED).top_logprobs is None
