"""An RL loop written the tinker-cookbook way against `roll serve`: sample a group per prompt
from the current weights (``save_weights_and_get_sampling_client``), score every sampled token,
centre the scores within each group, train with the ``importance_sampling`` loss on the
sampler's log-probs. The task is one the random tiny model can learn in a few steps: emit token
ids below 64 (a fifth of its 320). The mean reward rises."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.serve.test_serve_tinker import Server

VLLM = ("sample.engine=vllm", "sample.cpu_kv_cache_gb=0.25", "train.num_threads=1")
"""The overrides that sample on vLLM (a small KV cache: the tiny model's contexts are short)."""

tinker = pytest.importorskip(
    "tinker", reason="the tinker client is not installed (pip install tinker==0.38.0)"
)
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPTS = [[5, 6, 7], [11, 12, 13, 14]]
GROUP, TOKENS, STEPS, LR = 8, 4, 12, 5e-2


@pytest.mark.parametrize(
    "engine",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
            ),
        ),
    ],
)
def test_importance_sampling_rl_raises_the_reward(tmp_path, engine: str) -> None:
    """The same loop with each engine sampling: hf (a merged copy per step), vllm (the step's
    adapter loaded per request)."""
    extra = VLLM if engine == "vllm" else ()
    srv = Server(tmp_path / "ckpt", tmp_path / "cache", *extra)
    service = None
    try:
        service = tinker.ServiceClient(base_url=srv.url, api_key="tml-local")
        tc = service.create_lora_training_client(
            base_model="roll/tiny-qwen3", rank=8, seed=0
        ).result()
        rewards = []
        for step in range(STEPS):
            sampler = tc.save_weights_and_get_sampling_client().result()
            # seeded (sample i of a request draws from seed + i): the same run every time
            futures = [
                sampler.sample(
                    types.ModelInput.from_ints(p),
                    GROUP,
                    types.SamplingParams(
                        max_tokens=TOKENS, temperature=1.0, seed=1000 * step + 100 * j
                    ),
                )
                for j, p in enumerate(PROMPTS)
            ]
            data, starts, step_rewards = [], [], []
            for prompt, fut in zip(PROMPTS, futures, strict=True):
                seqs = fut.result().sequences
                scores = [(np.asarray(s.tokens) < 64).astype(np.float32) for s in seqs]
                baseline = float(np.mean(np.concatenate(scores)))
                step_rewards += [float(x.mean()) for x in scores]
                for seq, score in zip(seqs, scores, strict=True):
                    data.append(_datum(prompt, seq, score - baseline))
                    starts.append(len(prompt) - 1)
            rewards.append(float(np.mean(step_rewards)))
            out = tc.forward_backward(data, "importance_sampling").result()
            # on-policy: the trainer's log-probs of the sampled tokens are the sampler's
            for d, o, n in zip(data, out.loss_fn_outputs, starts, strict=True):
                q = np.asarray(d.loss_fn_inputs["logprobs"].tolist())
                got = np.asarray(o["logprobs"].tolist())
                np.testing.assert_allclose(got[n:], q[n:], atol=2e-4)
            tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    finally:
        if service is not None:
            service.close("success").result()  # its heartbeat thread ends with the session
        srv.stop()
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards


def _datum(prompt: list[int], seq, advantages: np.ndarray) -> types.Datum:
    sampled = list(seq.tokens)
    full = prompt + sampled
    pad = [0.0] * (len(prompt) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(full[1:], dtype=np.int64),
            "logprobs": np.asarray(pad + list(seq.logprobs), dtype=np.float32),
            "advantages": np.asarray(pad + advantages.tolist(), dtype=np.float32),
        },
    )
