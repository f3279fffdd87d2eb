"""On-policy distillation's teacher log-probs against an independent computation (CPU, the
real tiny model, a few seconds).

The teacher's log-probs go through the padded rollout batch, the teacher batch (another prompt
when the teacher has privileged context), micro-batches and the move back to the student's
positions. Each is checked here against the plainest possible reference: one unpadded forward
of [the teacher's prompt + the sampled response] per row, the log-softmax of the logits at
position t-1 (divided by the temperature) read at token t. An off-by-one, a prompt rendered
differently for the teacher, a misplaced EOS or padding token, or a temperature applied on one
side only shows up as a difference of order 0.1 to 10 nats; agreement is to 1e-5.

And the identity check of the brief: the student's own weights, given to the teacher by path
(a local directory, as a recipe would), against the student's trainer (the torch backend that
computes `old_log_probs`): every reverse-KL term and every advantage is 0 to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from roll_core.algorithms.on_policy_distill import on_policy_distill_advantages
from roll_core.backends.train import get_train_backend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.config.on_policy_distill import OnPolicyDistillConfig
from roll_core.data import encode_prompt
from roll_core.models import load_causal_lm, load_tokenizer
from roll_core.models.builtin import materialize_builtin
from roll_core.pipelines.on_policy_distill import (
    teacher_distributions,
    teacher_log_probs,
    teacher_prompts,
)
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.one_turn import Prompt, Sample
from roll_core.workers.reference import Reference

ROWS = [  # prompts of different lengths, so rows are padded differently
    {"prompt": "What is 84 + 76?", "answer": "160", "domain": "math"},
    {"prompt": "What is 7 - 3?", "answer": "4", "domain": "math"},
    {"prompt": "What is 49 + 44 + 1000?", "answer": "1093", "domain": "math"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """builtin:tiny-qwen3 as a local HF directory: the path a recipe would give."""
    return str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("models")))


def sampled_batch(
    path: str, temperature: float, *, in_vocab: bool = False
) -> tuple[object, list[Prompt], object]:
    """Three responses sampled from the model (the last ends with EOS, the others are cut),
    in the rollout batch layout (right-padded). The untrained model also samples ids beyond
    the tokenizer's 259 (its embedding has 320 rows); `in_vocab` replaces those by '1' (mode
    full's distributions cover the tokenizer's ids only)."""
    tok = load_tokenizer(path)
    model = load_causal_lm(path, device=torch.device("cpu"), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts, samples = [], []
    for i, row in enumerate(ROWS):
        p = Prompt(index=i, prompt_ids=encode_prompt(tok, row["prompt"]), row=row)
        ids = list(p.prompt_ids)
        with torch.no_grad():
            for _ in range(3 + i):
                logits = model(torch.tensor([ids])).logits[0, -1] / temperature
                ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
        response = ids[len(p.prompt_ids) :]
        if in_vocab:
            response = [x if x < len(tok) else tok.convert_tokens_to_ids("1") for x in response]
        if i == 2:
            response[-1] = tok.eos_token_id  # an EOS token is scored like any other
        prompts.append(p)
        samples.append(Sample(uid=i, group=i, prompt=p, response_ids=response,
                              log_probs=[0.0] * len(response), finish_reason="stop",
                              policy_version=0, reward_info={"domain": "math"}))  # fmt: skip
    batch = build_rl_batch([[s] for s in samples], pad_id=tok.pad_token_id)
    return batch, prompts, tok


def reference_log_probs(model: torch.nn.Module, head: list[int], response: list[int],
                        temperature: float) -> list[float]:  # fmt: skip
    """log p(response[k] | head + response[:k]) from one unpadded forward."""
    ids = torch.tensor([head + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    return [float(logp[len(head) - 1 + k, tok]) for k, tok in enumerate(response)]


def teacher(path: str, micro_batch_size: int = 2) -> Reference:
    worker = Reference(model_path=path, device="cpu", micro_batch_size=micro_batch_size,
                       num_threads=1, rank=0, world_size=1)  # fmt: skip
    worker.setup()
    return worker


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_scores_each_sampled_token_at_its_position(model_dir, temperature) -> None:
    batch, prompts, _ = sampled_batch(model_dir, temperature)
    opd = OnPolicyDistillConfig(teacher={"path": model_dir})
    got = teacher_log_probs(batch, {"teacher": teacher(model_dir)}, opd, {}, pad_id=0,
                            temperature=temperature)  # fmt: skip
    model = load_causal_lm(model_dir, device=torch.device("cpu"), dtype=torch.float32).eval()
    t = batch.tensors
    for i, p in enumerate(prompts):
        r = int(t["response_lengths"][i])
        start = len(p.prompt_ids) - 1  # target position of the first response token
        response = t["input_ids"][i, start + 1 : start + 1 + r].tolist()
        want = reference_log_probs(model, p.prompt_ids, response, temperature)
        assert got[i, start : start + r].tolist() == pytest.approx(want, abs=1e-5)
        # nothing outside the response: prompt and padding positions stay 0
        assert got[i, :start].abs().sum() == 0 and got[i, start + r :].abs().sum() == 0


def test_privileged_teacher_scores_the_response_after_its_own_prompt(model_dir) -> None:
    """context_key: the teacher's prompt is longer than the student's (the answer added), and
    its log-probs must come back to the student's positions of the same tokens."""
    batch, prompts, tok = sampled_batch(model_dir, 1.0)
    opd = OnPolicyDistillConfig(teacher={"context_key": "answer"})
    contexts = teacher_prompts(opd, prompts, prompt_key="prompt",
                               encode=lambda text: encode_prompt(tok, text), source="rows")  # fmt: skip
    got = teacher_log_probs(batch, {"teacher": teacher(model_dir)}, opd, contexts,
                            pad_id=tok.pad_token_id, temperature=1.0)  # fmt: skip
    model = load_causal_lm(model_dir, device=torch.device("cpu"), dtype=torch.float32).eval()
    t = batch.tensors
    for i, p in enumerate(prompts):
        head = contexts["teacher"][i]
        # the teacher's prompt: the same chat template around "<prompt>\n\nReference answer: <a>"
        assert head == encode_prompt(tok, f"{ROWS[i]['prompt']}\n\nReference answer: "
                                          f"{ROWS[i]['answer']}")  # fmt: skip
        assert len(head) > len(p.prompt_ids)
        r, start = int(t["response_lengths"][i]), len(p.prompt_ids) - 1
        response = t["input_ids"][i, start + 1 : start + 1 + r].tolist()
        want = reference_log_probs(model, head, response, 1.0)
        assert got[i, start : start + r].tolist() == pytest.approx(want, abs=1e-5)
        # and it really is another distribution than the student's own prompt gives
        own = reference_log_probs(model, p.prompt_ids, response, 1.0)
        assert max(abs(a - b) for a, b in zip(want, own, strict=True)) > 1e-3


def test_the_students_own_path_as_teacher_gives_zero_kl_and_advantages(model_dir) -> None:
    """(a) teacher == student: the trainer's old log-probs (torch backend, packed rows, as
    actor_train computes them) and the teacher's (Reference worker, padded micro-batches of 2)
    agree to 1e-6, so every reverse-KL term and every advantage is 0."""
    batch, _, _ = sampled_batch(model_dir, 1.0)
    spec = TrainBackendSpec(model_path=model_dir, device="cpu", num_threads=1)
    student = get_train_backend("torch")(spec)
    old = student.log_probs(batch, temperature=1.0)
    opd = OnPolicyDistillConfig(teacher={"path": model_dir})
    lp = teacher_log_probs(batch, {"teacher": teacher(model_dir)}, opd, {}, pad_id=0,
                           temperature=1.0)  # fmt: skip
    mask = batch.tensors["response_mask"]
    assert float(((old - lp) * mask).abs().max()) < 1e-6
    assert float((old * mask).abs().sum()) > 1.0  # real log-probs, not zeros on both sides
    adv, metrics = on_policy_distill_advantages(
        teacher_log_probs=lp, student_log_probs=old, response_mask=mask
    )
    assert float(adv.abs().max()) < 1e-6
    assert abs(metrics["distill/reverse_kl"]) < 1e-6


@pytest.mark.parametrize("top_k", [None, 5])
def test_full_mode_distributions_sit_at_the_sampled_positions(model_dir, top_k) -> None:
    """mode full: the teacher's whole next-token distribution (privileged prompt, so moved
    back) at each response position, against the unpadded forward; top_k: the k largest
    log-probs in order, then the log of the rest."""
    batch, prompts, tok = sampled_batch(model_dir, 1.0, in_vocab=True)
    opd = OnPolicyDistillConfig(teacher={"context_key": "answer"}, mode="full", top_k=top_k)
    contexts = teacher_prompts(opd, prompts, prompt_key="prompt",
                               encode=lambda text: encode_prompt(tok, text), source="rows")  # fmt: skip
    vocab = len(tok)
    got = teacher_distributions(batch, {"teacher": teacher(model_dir)}, opd, contexts,
                                pad_id=tok.pad_token_id, temperature=1.0, vocab_size=vocab)  # fmt: skip
    model = load_causal_lm(model_dir, device=torch.device("cpu"), dtype=torch.float32).eval()
    t = batch.tensors
    for i, p in enumerate(prompts):
        head, r, start = (
            contexts["teacher"][i],
            int(t["response_lengths"][i]),
            len(p.prompt_ids) - 1,
        )
        response = t["input_ids"][i, start + 1 : start + 1 + r].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([head + response])).logits[0, :, :vocab]
        want = torch.log_softmax(logits.float(), -1)[len(head) - 1 : len(head) - 1 + r]
        dist = got["teacher_dist_logprobs"][i, start : start + r]
        if top_k is None:
            assert torch.allclose(dist, want, atol=1e-5)
        else:
            values, ids = want.topk(top_k, dim=-1)
            assert torch.allclose(dist[:, :top_k], values, atol=1e-5)
            assert got["teacher_dist_ids"][i, start : start + r].tolist() == ids.tolist()
            rest = 1 - values.exp().sum(-1)
            assert torch.allclose(dist[:, top_k].exp(), rest, atol=1e-5)
        assert got["teacher_dist_logprobs"][i, :start].abs().sum() == 0
