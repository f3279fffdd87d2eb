"""The hf engine's log-probs of the sampled tokens (fixed-batch `generate`): recorded by a logits
processor one decoding step at a time, from the raw logits, and never from a checkpoint's own
sampling settings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from roll_core.backends.infer import Request, SamplingParams
from roll_core.backends.infer.hf import HFInferBackend, SampledLogProbs
from roll_core.models.builtin import materialize_builtin


def _run(recorder: SampledLogProbs, steps: list[torch.Tensor], tokens: torch.Tensor) -> list:
    """Drive `recorder` as generate does: step t sees the ids sampled before it."""
    prompt = torch.zeros((tokens.shape[0], 3), dtype=torch.long)
    returned = []
    for t, scores in enumerate(steps):
        ids = torch.cat([prompt, tokens[:, :t]], dim=1)
        returned.append(recorder(ids, scores.clone()))
    return returned


def test_hand_computed_values() -> None:
    # step 0: logits (0, ln 3); at temperature 2 that is (0, ln 3 / 2): p = (1, sqrt 3) /
    # (1 + sqrt 3). Step 1 at temperature 2: (0, 2 ln 2) / 2 = (0, ln 2): p = (1/3, 2/3)
    steps = [
        torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]]),
        torch.tensor([[0.0, 2 * math.log(2.0)], [0.0, 2 * math.log(2.0)]]),
    ]
    tokens = torch.tensor([[1, 0], [0, 1]])
    recorder = SampledLogProbs(2.0)
    returned = _run(recorder, steps, tokens)
    assert all(torch.equal(r, s) for r, s in zip(returned, steps, strict=True))  # untouched
    got = recorder.finish(tokens)
    s3 = math.sqrt(3.0)
    want = [
        [math.log(s3 / (1 + s3)), math.log(1 / 3)],
        [math.log(1 / (1 + s3)), math.log(2 / 3)],
    ]
    assert got.dtype == torch.float32 and got.shape == (2, 2)
    torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-6)


def test_same_as_one_stacked_pass_and_holds_one_step() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, 1000, generator=g).to(torch.bfloat16) for _ in range(5)]
    tokens = torch.randint(0, 1000, (3, 5), generator=g)
    recorder = SampledLogProbs(0.7)
    _run(recorder, steps, tokens)
    assert recorder.last is not None and recorder.last.shape == (3, 1000)  # one step held
    stacked = torch.stack(steps, dim=1).float() / 0.7
    want = torch.log_softmax(stacked, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(recorder.finish(tokens), want)
    assert recorder.last is None


def test_suppressed_ids_leave_sampling_but_not_the_log_probs() -> None:
    scores = torch.tensor([[0.0, math.log(3.0), 0.0]])
    recorder = SampledLogProbs(1.0, suppress=[1])
    out = recorder(torch.zeros((1, 2), dtype=torch.long), scores.clone())
    assert out[0, 1] == -math.inf and out[0, 0] == 0 and out[0, 2] == 0
    # the log-prob is of the raw logits, what the trainer recomputes: p(0) = 1 / 5
    got = recorder.finish(torch.tensor([[0]]))
    assert abs(got.item() - math.log(1 / 5)) < 1e-6


def test_no_new_tokens() -> None:
    assert SampledLogProbs(1.0).finish(torch.zeros((4, 0), dtype=torch.long)).shape == (4, 0)


def test_a_checkpoints_sampling_settings_do_not_leak_into_generation(tmp_path: Path) -> None:
    """A checkpoint whose generation_config.json asks for a repetition penalty (as
    Qwen2.5-Instruct's does, 1.05; here 50, so it shows): the engine still samples from
    softmax(raw logits / T), the distribution it reports log-probs for. Greedy tokens are the
    argmax of a trainer forward's logits and the log-probs equal that forward's within 1e-5;
    without the neutral generation config the penalty changes the greedy tokens."""
    path = materialize_builtin("tiny-qwen3", tmp_path)
    cfg_path = Path(path) / "generation_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg_path.write_text(json.dumps({**cfg, "repetition_penalty": 50.0, "top_k": 1}))
    b = HFInferBackend(model_path=str(path), device="cpu", num_threads=1)
    try:
        gen = torch.Generator().manual_seed(0)
        for t in b.model.parameters():
            if t.dim() == 2:
                t.data.normal_(0, 0.15, generator=gen)  # varied responses (the init is flat)
        reqs = [
            Request(i, [(7 * i + 3 * k) % 250 + 3 for k in range(4 + 3 * i)], seed=i)
            for i in range(4)
        ]
        greedy = b.generate(reqs, SamplingParams(max_new_tokens=12, temperature=0))
        sampled = b.generate(reqs, SamplingParams(max_new_tokens=12, temperature=0.7))
        repeats = 0
        for r, g, s in zip(reqs, greedy, sampled, strict=True):
            for c, temp in ((g, 1.0), (s, 0.7)):
                ids = torch.tensor([r.prompt_ids + c.response_ids])
                with torch.no_grad():
                    logits = b.model(input_ids=ids).logits[0].float()
                n = len(r.prompt_ids)
                step = logits[n - 1 : -1]
                if c is g:
                    assert step.argmax(-1).tolist() == c.response_ids
                    repeats += len(c.response_ids) - len(set(c.response_ids))
                logp = torch.log_softmax(step / temp, dim=-1)
                want = logp.gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1)
                assert (want - torch.tensor(c.log_probs)).abs().max() < 1e-5
        assert repeats > 0  # a penalty of 50 would have changed these greedy responses
    finally:
        b.close()


def _scrambled_backend(tmp_path: Path) -> HFInferBackend:
    b = HFInferBackend(
        model_path=str(materialize_builtin("tiny-qwen3", tmp_path)), device="cpu", num_threads=1
    )
    gen = torch.Generator().manual_seed(0)
    for t in b.model.parameters():
        if t.dim() == 2:
            t.data.normal_(0, 0.15, generator=gen)
    return b


def test_rows_that_share_a_prompt_prefill_it_once_and_decode_as_alone(tmp_path: Path) -> None:
    """A GRPO step's rows share their prompt: the fixed-batch path prefills each distinct
    prompt once (shared_prompt_cache). Each row's greedy tokens equal the row generated alone
    (no cache, no padding), and sampled rows' log-probs equal a trainer forward within 1e-5,
    for prompts of different lengths (left padding) and a partial-rollout prefix."""
    b = _scrambled_backend(tmp_path)
    try:
        prompts = [[(7 * i + 3 * k) % 250 + 3 for k in range(3 + 4 * i)] for i in range(3)]
        reqs = [Request(4 * i + j, prompts[i], seed=4 * i + j) for i in range(3) for j in range(4)]
        reqs.append(Request(12, prompts[0], seed=12, prefix_ids=[40, 41]))  # its own input
        ids = torch.full((len(reqs), 12), 0)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            x = r.prompt_ids + r.prefix_ids
            ids[i, 12 - len(x) :], attn[i, 12 - len(x) :] = torch.tensor(x), 1
        from roll_core.backends.infer.hf import shared_prompt_cache

        with torch.no_grad():
            cache = shared_prompt_cache(b.model, ids, attn, b.device)
            assert cache is not None and cache.get_seq_length() == 11
            assert (
                shared_prompt_cache(b.model, ids[[0, 4, 8, 12]], attn[[0, 4, 8, 12]], b.device)
                is None
            )
        greedy = SamplingParams(max_new_tokens=10, temperature=0)
        together = b.generate(reqs, greedy)
        for r, c in zip(reqs, together, strict=True):
            alone = b.generate([r], greedy)[0]
            assert c.response_ids == alone.response_ids
            assert max(abs(x - y) for x, y in zip(c.log_probs, alone.log_probs, strict=True)) < 1e-5
        sampled = b.generate(reqs, SamplingParams(max_new_tokens=10, temperature=0.8))
        assert len({tuple(c.response_ids) for c in sampled[:4]}) > 1  # samples still differ
        for r, c in zip(reqs, sampled, strict=True):
            full = torch.tensor([r.prompt_ids + r.prefix_ids + c.response_ids])
            with torch.no_grad():
                logits = b.model(input_ids=full).logits[0].float() / 0.8
            n = len(r.prompt_ids) + len(r.prefix_ids)
            logp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
            want = logp.gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1)
            assert (want - torch.tensor(c.log_probs)).abs().max() < 1e-5
    finally:
        b.close()
