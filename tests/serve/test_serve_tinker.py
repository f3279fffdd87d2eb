"""`roll serve` end to end: the real CLI in a subprocess on the built-in tiny model, driven by
the real `tinker` client (PyPI tinker 0.38.0): LoRA training (the SFT loss falls), sampling
(its log-probs equal a forward of the trained model), checkpoints (save, load, listing, a
restarted server loads them), and the client's error shapes for bad requests."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROLL, ROOT, make_cli_env

tinker = pytest.importorskip(
    "tinker", reason="the tinker client is not installed (pip install tinker==0.38.0)"
)
from tinker import types  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    # load_state (a route the cookbook's older recipes still call) is deprecated in the client
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
RECIPE = ROOT / "recipes" / "serve" / "tiny.yaml"


class Server:
    """A `roll serve` subprocess and its base URL."""

    def __init__(self, ckpt: Path, cache: Path, *overrides: str) -> None:
        env = {**make_cli_env(cache), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [ROLL, "serve", str(RECIPE), "port=0", f"checkpoints_dir={ckpt}", *overrides],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the first line: nothing else comes before it
        if not line.startswith("serving the Tinker API at "):
            self.proc.kill()
            raise AssertionError(f"roll serve did not start: {line}{self.proc.stderr.read()}")
        self.url = line.split(" at ", 1)[1].strip()

    def stop(self, sig: int = signal.SIGINT) -> int:
        """Stop it with `sig`; its exit code (130: stopped as asked)."""
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("roll serve did not stop on a signal") from None
        if code != 130:  # say why: an abort at exit prints its reason here
            assert self.proc.stderr is not None
            print(f"roll serve exited with {code}; its stderr:\n{self.proc.stderr.read()}")
        return code


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve") / "ckpt"


@pytest.fixture(scope="module")
def server(ckpt_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(ckpt_dir, tmp_path_factory.mktemp("cache"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def service(server: Server):
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    yield client
    client.close("success").result()  # stops its heartbeat thread before the server goes


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


SFT = [[5, 17, 23, 42, 8, 9, 10, 11], [7, 3, 99, 100, 101, 5], [12, 13, 14, 15, 16, 17, 18]]
ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)


def _logprobs(tc, tokens: list[int]) -> np.ndarray:
    out = tc.forward([_datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)


def test_capabilities(server: Server) -> None:
    rest = tinker.RestClient(base_url=server.url, api_key="tml-local")
    caps = rest.get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    assert names == ["Qwen/Qwen3-8B", "roll/tiny-qwen3"]


def test_sft_loss_falls_and_samples_match_a_forward(service) -> None:
    tc = service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    info = tc.get_info()
    assert info.lora_rank == 8 and info.model_data.model_name == "Qwen/Qwen3-8B"
    data = [_datum(t) for t in SFT]
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        # the loss is the weighted NLL sum; the per-token log-probs add up to it
        total = -sum(float(np.sum(o["logprobs"].tolist())) for o in fb.loss_fn_outputs)
        assert fb.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
        losses.append(fb.metrics["loss:sum"])
    assert losses[-1] < 0.7 * losses[0], losses

    path = tc.save_weights_for_sampler("after-sft").result().path
    assert path.endswith("/sampler_weights/after-sft")
    sampler = service.create_sampling_client(model_path=path).result()
    prompt = [5, 17, 23]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=3,
        sampling_params=params,
        include_prompt_logprobs=True,
    ).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        full = prompt + list(seq.tokens)
        forward = _logprobs(tc, full)  # log p(full[t+1] | full[:t+1]) by the trainer
        np.testing.assert_allclose(seq.logprobs, forward[len(prompt) - 1 :], atol=2e-4)
    forward = _logprobs(tc, prompt + [1])
    assert res.prompt_logprobs[0] is None
    np.testing.assert_allclose(res.prompt_logprobs[1:], forward[: len(prompt) - 1], atol=2e-4)


def test_stop_tokens_and_greedy(service) -> None:
    check_stop_tokens_and_greedy(service)


def check_stop_tokens_and_greedy(service) -> None:
    """Greedy repeats itself; a stop token ends a response after it; stop=[] runs to
    max_tokens (eos included)."""
    sampler = service.create_sampling_client(base_model="roll/tiny-qwen3").result()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    first = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, greedy).result()
    tokens = list(first.sequences[0].tokens)
    again = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, greedy).result()
    assert [list(s.tokens) for s in again.sequences] == [tokens, tokens]
    stop_at = tokens[2]
    stop = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_at])
    cut = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, stop).result().sequences[0]
    assert list(cut.tokens) == tokens[: tokens.index(stop_at) + 1]
    assert cut.stop_reason == "stop"
    # stop=[]: nothing but max_tokens ends a response (eos included)
    endless = types.SamplingParams(max_tokens=12, temperature=1.0, stop=[], seed=1)
    long = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 4, endless).result()
    assert [len(s.tokens) for s in long.sequences] == [12] * 4
    assert {s.stop_reason for s in long.sequences} == {"length"}


def test_save_load_listing_and_restart(service, server: Server, ckpt_dir: Path) -> None:
    meta = {"renderer_name": "qwen3"}  # what tinker-cookbook's loops attach
    tc = service.create_lora_training_client(
        base_model="roll/tiny-qwen3", rank=4, user_metadata=meta
    ).result()
    data = [_datum(t) for t in SFT]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    saved = tc.save_state("one").result().path
    before = _logprobs(tc, SFT[0])
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    assert not np.allclose(_logprobs(tc, SFT[0]), before)
    tc.load_state_with_optimizer(saved).result()
    np.testing.assert_allclose(_logprobs(tc, SFT[0]), before, atol=1e-6)

    rest = tinker.RestClient(base_url=server.url, api_key="tml-local")
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [saved]
    assert listed[0].checkpoint_type == "training"
    # the training run, as the cookbook reads it to check a checkpoint's renderer
    run = rest.get_training_run_by_tinker_path(saved).result()
    assert (run.training_run_id, run.base_model, run.lora_rank) == (
        tc.model_id,
        "roll/tiny-qwen3",
        4,
    )
    assert run.user_metadata == meta and run.last_checkpoint is not None
    assert run.last_checkpoint.tinker_path == saved and run.last_sampler_checkpoint is None
    with pytest.raises(tinker.NotFoundError, match="unknown training run"):
        rest.get_training_run("sess-nope:train:0").result()

    # a second server on the same checkpoints_dir builds the model from the checkpoint
    other = Server(ckpt_dir, ckpt_dir.parent / "cache2")
    fresh = None
    try:
        fresh = tinker.ServiceClient(base_url=other.url, api_key="tml-local")
        restored = fresh.create_training_client_from_state(saved).result()
        np.testing.assert_allclose(_logprobs(restored, SFT[0]), before, atol=1e-6)
        other_rest = tinker.RestClient(base_url=other.url, api_key="tml-local")
        assert other_rest.get_training_run(tc.model_id).result().user_metadata == meta
    finally:
        if fresh is not None:
            fresh.close("success").result()  # its heartbeat thread ends with the session
        assert other.stop(signal.SIGTERM) == 130
        assert "stopped: roll serve stopped (SIGTERM)" in other.proc.stderr.read()


def test_bad_requests_get_the_client_error_shapes(service) -> None:
    with pytest.raises(tinker.BadRequestError, match="served models: Qwen/Qwen3-8B, roll/tiny"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-235B", rank=8).result()
    with pytest.raises(tinker.BadRequestError, match="max_rank 32"):
        service.create_lora_training_client(base_model="roll/tiny-qwen3", rank=64).result()
    tc = service.create_lora_training_client(base_model="roll/tiny-qwen3", rank=2).result()
    with pytest.raises(tinker.RequestFailedError, match="served built-in losses: cross_entropy"):
        tc.forward_backward([_datum(SFT[0])], "dro").result()
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3], dtype=np.int64), "weights": [1.0, 1.0]},
    )
    with pytest.raises(tinker.RequestFailedError, match="target_tokens has 2 entries for 3"):
        tc.forward_backward([bad], "cross_entropy").result()
    # the model still trains after a failed request
    assert tc.forward_backward([_datum(SFT[0])], "cross_entropy").result().metrics


def test_unserved_routes_answer_at_once(server: Server) -> None:
    import httpx

    start = time.monotonic()
    r = httpx.post(f"{server.url}/api/v1/create_custom_loss", json={})
    assert r.status_code == 404 and r.json()["category"] == "user"
    assert "not served by roll serve" in r.json()["error"]
    r = httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": "nope"})
    assert r.status_code == 404 and "unknown request_id" in r.json()["error"]
    r = httpx.post(f"{server.url}/api/v1/create_session", content=b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    assert time.monotonic() - start < 5


def test_dry_run_prints_the_plan(roll) -> None:
    res = roll("serve", str(RECIPE), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "model Qwen/Qwen3-8B" in res.stdout and "recipe is valid" in res.stdout
    res = roll("serve", str(RECIPE), "--dry-run", "sample.engine=vllm")
    assert res.returncode == 0, res.stderr
    assert "vllm: 1 engine(s), one per model directory" in res.stdout  # two names, one model
    res = roll("serve", str(RECIPE), "--dry-run", "sample.cpu_kv_cache_gb=2")
    assert res.returncode == 2 and "cpu_kv_cache_gb sizes the vllm engine" in res.stderr
    res = roll("serve", str(RECIPE), "lora.max_rnk=3")
    assert res.returncode == 2
    assert "lora.max_rnk: unknown key; did you mean lora.max_rank?" in res.stderr
    res = roll("serve", str(RECIPE), "models.0.path=builtin:nope", "port=0")
    assert res.returncode == 2 and "unknown built-in model 'builtin:nope'" in res.stderr
    res = roll("validate", str(RECIPE))
    assert res.returncode == 2 and "roll serve RECIPE --dry-run" in res.stderr
    res = roll("serve", str(ROOT / "recipes" / "tiny-arith-sft.yaml"), "--dry-run")
    assert res.returncode == 2 and "is for `sft`, not `serve`" in res.stderr


def test_a_closed_session_frees_its_models(server: Server) -> None:
    import httpx

    own = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    tc = own.create_lora_training_client(base_model="roll/tiny-qwen3", rank=2).result()
    r = httpx.post(f"{server.url}/api/v1/get_info", json={"model_id": tc.model_id})
    assert r.status_code == 200 and r.json()["lora_rank"] == 2
    own.close("success").result()
    r = httpx.post(f"{server.url}/api/v1/get_info", json={"model_id": tc.model_id})
    assert r.status_code == 404 and "unknown model_id" in r.json()["error"]
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}
    r = httpx.post(f"{server.url}/api/v1/cancel_future", json={"request_id": "req-0"})
    assert r.json() == {"cancelled": False}
