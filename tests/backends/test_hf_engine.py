"""The hf backend's request-level engine (continuous batching, backends/infer/hf_engine.py):
each request's answer is the fixed-batch path's, whatever else is in flight; abort, pause,
finish reasons, streaming order, vision-language requests, and the ActorInfer route."""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.backends.infer.hf import HFInferBackend
from roll_core.backends.infer.hf_engine import EngineClosed, warp
from roll_core.models.builtin import materialize_builtin

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
SAMPLE = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("cache")))


@functools.cache
def _scrambled(model_path: str) -> dict[str, torch.Tensor]:
    """Weights drawn with std 0.15 (seed 0): the built-in's own init is so flat that greedy
    repeats one token; these give varied responses, so equality tests mean something."""
    gen = torch.Generator().manual_seed(0)
    from roll_core.models import load_causal_lm

    return {
        name: (t.detach().normal_(0, 0.15, generator=gen) if t.dim() == 2 else t.detach())
        for name, t in load_causal_lm(model_path, dtype=torch.float32).named_parameters()
    }


def _make(model_path: str, **kwargs: object) -> HFInferBackend:
    b = HFInferBackend(model_path=model_path, device="cpu", num_threads=1, **kwargs)  # type: ignore[arg-type]
    if b.is_vision:
        return b
    b.update_weights(_scrambled(model_path), version=0)
    return b


@pytest.fixture
def backend(model_path: str) -> Iterator[HFInferBackend]:
    b = _make(model_path)
    yield b
    b.close()


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(16) as ex:
        yield ex


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 3 * k) % 250 + 3 for k in range(length)]


def _submit(
    pool: ThreadPoolExecutor, b: HFInferBackend, r: Request, p: SamplingParams
) -> Future[Completion]:
    return pool.submit(b.generate_request, r, p)


def _gap(a: Completion, b: Completion) -> float:
    return max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True))


def _wait_for(cond, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.005)


def _tokens_so_far(b: HFInferBackend, request_id: int) -> int:
    seq = b.engine._by_id.get(request_id)
    return len(seq.tokens) if seq is not None else -1


def test_warp_top_k_and_top_p_by_hand() -> None:
    # scores ln 4, ln 2, ln 1, ln 1 -> probs 0.5, 0.25, 0.125, 0.125
    scores = torch.tensor([[4.0, 2.0, 1.0, 1.0]]).log().repeat(3, 1)
    params = [
        SamplingParams(top_k=2),  # keeps the two largest
        SamplingParams(top_p=0.7),  # ascending cum: .125 .25 .5 1 -> drop cum <= 0.3: two
        SamplingParams(),  # untouched
    ]
    out = warp(scores, params)
    inf = -math.inf
    assert out[0].tolist() == pytest.approx([math.log(4), math.log(2), inf, inf])
    assert out[1].tolist() == pytest.approx([math.log(4), math.log(2), inf, inf])
    assert out[2].tolist() == pytest.approx(scores[2].tolist())
    # greedy rows are never warped
    assert warp(scores[:1], [SamplingParams(temperature=0, top_k=1)]).isfinite().all()


@pytest.mark.parametrize("max_num_seqs", [64, 2])
def test_greedy_equals_the_fixed_batch_path(
    model_path: str, pool: ThreadPoolExecutor, max_num_seqs: int
) -> None:
    """fp32 greedy: each request's tokens equal `generate([request])` token for token, with
    log-probs within 1e-5, whether all decode together or two at a time (the rest queue)."""
    b = _make(model_path, max_num_seqs=max_num_seqs)
    try:
        reqs = [Request(i, _prompt(i, 3 + 4 * i), seed=i) for i in range(6)]
        reqs.append(Request(6, _prompt(6, 5), seed=6, prefix_ids=[40, 41, 42]))  # continuation
        futures = [_submit(pool, b, r, GREEDY) for r in reqs]
        for r, f in zip(reqs, futures, strict=True):
            got, want = f.result(timeout=120), b.generate([r], GREEDY)[0]
            assert got.response_ids == want.response_ids and len(got.response_ids) == 12
            assert got.finish_reason == want.finish_reason == "length"
            assert _gap(got, want) < 1e-5
        assert b.engine.in_flight() == 0
    finally:
        b.close()


def test_seeded_sampling_does_not_depend_on_other_requests(
    backend: HFInferBackend, pool: ThreadPoolExecutor
) -> None:
    """A sampled request alone and among 7 others of other lengths and params: the same
    tokens (its own generator); another seed gives another response."""
    target = Request(100, _prompt(1, 9), seed=1234)
    alone = backend.generate_request(target, SAMPLE)
    others = [
        (Request(i, _prompt(i, 2 + 5 * i), seed=i), SamplingParams(max_new_tokens=4 + 3 * i))
        for i in range(7)
    ]
    futures = [_submit(pool, backend, r, p) for r, p in others[:4]]
    mid = _submit(pool, backend, target, SAMPLE)
    futures += [_submit(pool, backend, r, p) for r, p in others[4:]]
    among = mid.result(timeout=120)
    assert among.response_ids == alone.response_ids and len(alone.response_ids) == 16
    assert _gap(among, alone) < 1e-5
    eos = backend.tokenizer.eos_token_id
    for (_, p), f in zip(others, futures, strict=True):
        c = f.result(timeout=120)  # sampled: an eos may come early (kept, "stop")
        assert len(c.response_ids) == p.max_new_tokens or c.response_ids[-1] == eos
    reseeded = backend.generate_request(Request(101, target.prompt_ids, seed=99), SAMPLE)
    assert reseeded.response_ids != alone.response_ids


def test_behaviour_log_probs_equal_a_trainer_forward(
    backend: HFInferBackend, pool: ThreadPoolExecutor
) -> None:
    """log softmax(raw logits / T) of each sampled token, recomputed by one full forward of
    prompt + response (what the trainer does), within 1e-5, for requests that decoded
    together with different left padding; top_k/top_p do not enter the log-probs."""
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.8)
    reqs = [Request(i, _prompt(i, 2 + 6 * i), seed=10 + i) for i in range(4)]
    outs = [f.result(timeout=120) for f in [_submit(pool, backend, r, params) for r in reqs]]
    for r, c in zip(reqs, outs, strict=True):
        ids = torch.tensor([r.prompt_ids + c.response_ids])
        with torch.no_grad():
            logits = backend.model(input_ids=ids).logits[0].float() / 0.7
        n = len(r.prompt_ids)
        logp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
        want = logp.gather(-1, torch.tensor(c.response_ids).unsqueeze(-1)).squeeze(-1)
        assert (want - torch.tensor(c.log_probs)).abs().max() < 1e-5


def test_top_k_one_is_greedy_and_suppressed_ids_are_never_sampled(model_path: str) -> None:
    b = _make(model_path)
    try:
        r = Request(0, _prompt(3, 7), seed=5)
        greedy = b.generate_request(r, GREEDY)
        top1 = b.generate_request(r, SamplingParams(max_new_tokens=12, top_k=1))
        assert top1.response_ids == greedy.response_ids
        b.suppress = sorted(set(greedy.response_ids))  # what an image placeholder gets
        for params in (GREEDY, SAMPLE):
            c = b.generate_request(r, params)
            assert not set(c.response_ids) & set(b.suppress)
    finally:
        b.close()


def test_finish_reasons_eos_stop_string_and_length_match_the_fixed_batch_path(
    model_path: str,
) -> None:
    b = _make(model_path)
    try:
        r = Request(0, _prompt(2, 6), seed=0)
        full = b.generate_request(r, GREEDY)
        assert full.finish_reason == "length" and len(full.response_ids) == 12
        # a stop string: the decoded text of tokens 3-4 (the byte-level vocab: 1 char each)
        stop = b.tokenizer.decode(full.response_ids[3:5])
        assert stop not in b.tokenizer.decode(r.prompt_ids + full.response_ids[:4])
        params = SamplingParams(max_new_tokens=12, temperature=0, stop=(stop,))
        got, want = b.generate_request(r, params), b.generate([r], params)[0]
        assert got.finish_reason == want.finish_reason == "stop"
        assert got.response_ids == want.response_ids
        assert stop in b.tokenizer.decode(got.response_ids)
        assert len(got.response_ids) == 5
        # eos: make token 6 of the response the eos; it is kept, as the fixed path keeps it
        eos = full.response_ids[6]
        cut = full.response_ids.index(eos) + 1
        b.tokenizer.eos_token = b.tokenizer.convert_ids_to_tokens(eos)
        got, want = b.generate_request(r, GREEDY), b.generate([r], GREEDY)[0]
        assert got.finish_reason == want.finish_reason == "stop"
        assert got.response_ids == want.response_ids == full.response_ids[:cut]
        assert len(got.log_probs) == cut
    finally:
        b.close()


def test_a_short_request_submitted_after_a_long_one_finishes_first(
    backend: HFInferBackend, pool: ThreadPoolExecutor
) -> None:
    long = _submit(pool, backend, Request(0, _prompt(0, 8), 0), SamplingParams(200, 0))
    _wait_for(lambda: _tokens_so_far(backend, 0) >= 2)
    short = _submit(pool, backend, Request(1, _prompt(1, 30), 1), SamplingParams(3, 0))
    done = short.result(timeout=120)
    assert not long.done() and len(done.response_ids) == 3
    assert 2 <= _tokens_so_far(backend, 0) < 200
    assert len(long.result(timeout=120).response_ids) == 200
    assert done.timing["gen_end"] < long.result().timing["gen_end"]


def test_abort_returns_the_partial_response_and_the_others_finish(
    backend: HFInferBackend, pool: ThreadPoolExecutor
) -> None:
    long_req = Request(0, _prompt(0, 8), 0)
    long = _submit(pool, backend, long_req, SamplingParams(300, 0))
    shorts = [
        _submit(pool, backend, Request(i, _prompt(i, 4 + i), i), SamplingParams(5, 0))
        for i in (1, 2, 3)
    ]
    assert [len(f.result(timeout=120).response_ids) for f in shorts] == [5, 5, 5]
    backend.abort([0, 12345])  # an unknown id is ignored
    partial = long.result(timeout=120)
    assert partial.finish_reason == "abort" and 5 <= len(partial.response_ids) < 300
    assert len(partial.log_probs) == len(partial.response_ids)
    n = len(partial.response_ids)
    want = backend.generate([long_req], SamplingParams(n, 0))[0]
    assert partial.response_ids == want.response_ids  # the tokens so far, exactly
    backend.abort([0, 1])  # finished: no-op
    again = backend.generate_request(Request(0, _prompt(0, 8), 0), SamplingParams(4, 0))
    assert again.response_ids == want.response_ids[:4]  # the id is free again
    # a queued request (not yet admitted) aborts with an empty response
    backend.pause()
    queued = _submit(pool, backend, Request(7, _prompt(7, 5), 7), GREEDY)
    _wait_for(lambda: backend.engine.in_flight() == 1)
    backend.abort([7])
    assert queued.result(timeout=30).response_ids == []
    assert queued.result().finish_reason == "abort"
    backend.resume()


def test_pause_stops_decoding_and_resume_continues_under_the_new_version(
    backend: HFInferBackend, pool: ThreadPoolExecutor
) -> None:
    r = Request(0, _prompt(4, 6), 0)
    fut = _submit(pool, backend, r, SamplingParams(60, 0))
    _wait_for(lambda: _tokens_so_far(backend, 0) >= 2)
    backend.pause()
    steps, made = backend.engine.steps, _tokens_so_far(backend, 0)
    late = _submit(pool, backend, Request(1, _prompt(5, 4), 1), SamplingParams(3, 0))
    time.sleep(0.3)
    assert backend.engine.steps == steps and _tokens_so_far(backend, 0) == made
    assert not fut.done() and not late.done()
    state = {k: v.clone() for k, v in backend.model.state_dict().items()}
    backend.update_weights(state, version=3)  # the same weights, a new version stamp
    backend.resume()
    out = fut.result(timeout=120)
    assert out.policy_version == 3 and late.result(timeout=120).policy_version == 3
    assert out.response_ids == backend.generate([r], SamplingParams(60, 0))[0].response_ids


def test_a_crashed_step_fails_every_waiting_request_and_the_engine_recovers(
    backend: HFInferBackend, pool: ThreadPoolExecutor
) -> None:
    backend.pause()
    futures = [_submit(pool, backend, Request(i, _prompt(i, 5), i), GREEDY) for i in range(3)]
    _wait_for(lambda: backend.engine.in_flight() == 3)
    forward = backend.model.forward

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("out of memory (simulated)")

    backend.model.forward = broken  # type: ignore[method-assign]
    backend.resume()
    for f in futures:
        with pytest.raises(RuntimeError, match="simulated"):
            f.result(timeout=30)
    backend.model.forward = forward  # type: ignore[method-assign]
    assert len(backend.generate_request(Request(9, _prompt(9, 4), 9), GREEDY).response_ids) == 12


def test_close_fails_waiting_requests_and_refuses_new_ones(
    model_path: str, pool: ThreadPoolExecutor
) -> None:
    b = HFInferBackend(model_path=model_path, device="cpu", num_threads=1)
    b.pause()
    fut = _submit(pool, b, Request(0, _prompt(0, 5), 0), GREEDY)
    _wait_for(lambda: b.engine.in_flight() == 1)
    b.close()
    with pytest.raises(EngineClosed):
        fut.result(timeout=30)
    with pytest.raises(EngineClosed):
        b.generate_request(Request(1, _prompt(1, 5), 1), GREEDY)


def test_bad_requests_are_refused_with_a_clear_error(backend: HFInferBackend) -> None:
    from roll_core.data.vision import VisionInputs
    from roll_core.errors import ConfigError, ModelError

    with pytest.raises(ConfigError, match="max_new_tokens"):
        backend.generate_request(Request(0, [5, 6], 0), SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="no prompt tokens"):
        backend.generate_request(Request(0, [], 0), GREEDY)
    image = VisionInputs(torch.zeros(4, 6), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ModelError, match="text-only"):
        backend.generate_request(Request(0, [5, 6], 0, vision=image), GREEDY)
    # a LoRA adapter per request is the vllm backend's; the hf engine refuses, never ignores
    with pytest.raises(ConfigError, match="serves no adapters"):
        backend.generate_request(Request(0, [5, 6], 0, adapter=1), GREEDY)
    with pytest.raises(ConfigError, match="serves none"):
        backend.generate([Request(0, [5, 6], 0, adapter=1)], GREEDY)


def test_weights_stashed_by_a_colocated_trainer_come_back_and_bf16_runs(model_path: str) -> None:
    b = _make(model_path, precision="bf16")
    try:
        r = Request(0, _prompt(0, 6), 0)
        want = b.generate([r], GREEDY)[0]
        assert b.release(["weights"]) > 0
        got = b.generate_request(r, GREEDY)
        # bf16 autocast in both paths: the same kernels on the same single row
        assert got.response_ids == want.response_ids
        assert _gap(got, want) < 1e-5
    finally:
        b.close()


def test_vision_language_requests_share_the_batch(pool: ThreadPoolExecutor, tmp_path: Path) -> None:
    """Tiny Qwen2.5-VL: image requests (one and two images) and a text-only one decode
    together; each equals the fixed-batch path on its own (greedy and log-probs)."""
    from PIL import Image

    from roll_core.data.chat import encode_chat_images, image_message
    from roll_core.models.vision import load_processor

    path = str(materialize_builtin("tiny-qwen2.5-vl", tmp_path))
    proc = load_processor(path)
    images = [
        [Image.new("RGB", (56, 56), (255, 0, 0))],
        [Image.new("RGB", (84, 56), (0, 0, 255)), Image.new("RGB", (56, 56), (0, 255, 0))],
        [],
    ]
    reqs = []
    for i, imgs in enumerate(images):
        ids, vision = encode_chat_images(
            proc, [image_message("count" + "!" * i, len(imgs))], imgs, add_generation_prompt=True
        )
        reqs.append(Request(i, ids, 7 + i, vision=vision))
    b = HFInferBackend(model_path=path, device="cpu", num_threads=1)
    try:
        assert b.suppress  # the image placeholder is never sampled
        params = SamplingParams(max_new_tokens=8, temperature=0)
        futures = [_submit(pool, b, r, params) for r in reqs]
        for r, f in zip(reqs, futures, strict=True):
            got, want = f.result(timeout=120), b.generate([r], params)[0]
            assert got.response_ids == want.response_ids and len(got.response_ids) > 0
            assert _gap(got, want) < 1e-5
    finally:
        b.close()


def test_through_actor_infer_on_a_local_cluster(model_path: str) -> None:
    """`infer.at(0).generate_request(...)` from several threads: futures that resolve to the
    fixed-batch path's answers; pause/abort reach the engine through the cluster."""
    from roll_core.engine import Cluster, LocalExecutor
    from roll_core.workers.actor_infer import ActorInfer

    infer = Cluster(
        "actor_infer",
        ActorInfer,
        LocalExecutor(),
        world_size=1,
        worker_kwargs={
            "backend": "hf",
            "backend_kwargs": {"model_path": model_path, "device": "cpu", "num_threads": 1},
        },
    )
    infer.run("setup")
    infer.update_weights(_scrambled(model_path), version=1)
    reqs = [Request(i, _prompt(i, 3 + 2 * i), seed=i) for i in range(5)]
    results: dict[int, Completion] = {}

    def call(r: Request) -> None:
        results[r.request_id] = infer.at(0).generate_request(r, GREEDY).result(timeout=120)

    threads = [threading.Thread(target=call, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    want = infer.at(0).generate(reqs, GREEDY).result(timeout=120)
    for w in want:
        assert results[w.request_id].response_ids == w.response_ids
    infer.pause_generation()
    held = infer.at(0).generate_request(Request(9, _prompt(9, 4), 9), GREEDY)
    kept = infer.at(0).generate_request(reqs[0], GREEDY)
    time.sleep(0.2)
    assert not held.done() and not kept.done()
    infer.abort_requests([9])
    assert held.result(timeout=30).finish_reason == "abort"
    # a (non-concurrent) weight load gets through while requests wait, as at a sync
    infer.update_weights(_scrambled(model_path), version=2)
    infer.resume_generation()
    again = kept.result(timeout=120)
    assert again.policy_version == 2 and again.response_ids == results[0].response_ids


@pytest.mark.parametrize("path", ["request", "batch"])
def test_top_logprobs_are_the_models_most_likely_tokens(backend: HFInferBackend, path: str) -> None:
    """``SamplingParams.top_logprobs``: at every generated position, the k most likely ids and
    their log softmax(logits / temperature), as one forward of the model gives them; the
    sampled token's behaviour log-prob is the same quantity."""
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_logprobs=3)
    request = Request(7, [5, 9, 13, 17, 21], seed=3)
    if path == "request":
        out = backend.generate_request(request, params)
    else:
        [out] = backend.generate([request], params)
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.response_ids)
    ids = torch.tensor([request.prompt_ids + out.response_ids])
    with torch.no_grad():
        logits = backend.model(input_ids=ids).logits[0].float()
    n = len(request.prompt_ids)
    logps = torch.log_softmax(logits[n - 1 : -1] / 0.7, dim=-1)
    for t, (tok, lp, top) in enumerate(
        zip(out.response_ids, out.log_probs, out.top_logprobs, strict=True)
    ):
        want = torch.topk(logps[t], 3)
        assert [i for i, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert lp == pytest.approx(logps[t, tok].item(), abs=1e-4)
    plain = backend.generate_request(Request(8, request.prompt_ids, seed=3), SAMPLE)
    assert plain.top_logprobs is None
