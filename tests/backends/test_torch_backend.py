"""The torch train backend: the loss by hand, accumulation invariance, exact save/load."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.torch_backend import (
    TorchTrainBackend,
    token_log_probs,
    token_loss_sum,
)
from roll_core.config.schema import OptimConfig
from roll_core.data import Batch
from roll_core.models import materialize_builtin
from roll_core.workers.objectives import sft


def test_token_loss_sum_by_hand() -> None:
    # Vocab 2, uniform logits -> every position costs ln 2. Sequence of 3 tokens: positions
    # 0 and 1 predict tokens 1 and 2; loss_mask marks token 2 only -> one term: ln 2.
    logits = torch.zeros(1, 3, 2)
    ids = torch.tensor([[0, 1, 1]])
    mask = torch.tensor([[0, 0, 1]])
    assert token_loss_sum(logits, ids, mask).item() == pytest.approx(math.log(2))
    # Confident right answer at the trained position: logit 10 on token 1 -> ln(1 + e^-10)
    logits[0, 1, 1] = 10.0
    assert token_loss_sum(logits, ids, mask).item() == pytest.approx(
        math.log1p(math.exp(-10)), abs=1e-6
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("cache")))


def backend(model_dir: str, micro: int) -> TorchTrainBackend:
    return TorchTrainBackend(
        TrainBackendSpec(
            model_path=model_dir,
            device="cpu",
            optim=OptimConfig(lr=1e-2),
            total_steps=10,
            micro_batch_size=micro,
            seed=0,
            num_threads=1,
        )
    )


def batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (8, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[::2, 9:] = 0  # ragged rows
    mask = attn.clone()
    mask[:, :4] = 0
    b = Batch(
        tensors={"input_ids": ids, "attention_mask": attn, "loss_mask": mask},
        non_tensors={},
        meta={},
    )
    b.meta["loss_tokens"] = int(mask[:, 1:].sum())
    return b


def test_grad_accumulation_equals_one_big_batch(model_dir: str) -> None:
    big, accum = backend(model_dir, micro=8), backend(model_dir, micro=2)
    m_big, m_acc = big.train_step(batch(), sft), accum.train_step(batch(), sft)
    assert m_big["train/loss_sum"] == pytest.approx(m_acc["train/loss_sum"], rel=1e-5)
    assert m_big["train/grad_norm"] == pytest.approx(m_acc["train/grad_norm"], rel=1e-4)
    # The step's gradients (still in .grad) match. Parameters after one Adam step are not
    # compared: Adam's sign-like first update amplifies 1e-9 noise on ~0 gradients.
    pairs = zip(big.model.named_parameters(), accum.model.named_parameters(), strict=True)
    for (n, a), (_, b) in pairs:
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-8), n


def test_save_load_continues_bitwise(model_dir: str, tmp_path: Path) -> None:
    a = backend(model_dir, micro=4)
    a.train_step(batch(), sft)
    a.save(tmp_path)
    a.train_step(batch(), sft)
    b = backend(model_dir, micro=4)
    b.load(tmp_path)
    b.train_step(batch(), sft)
    assert a.state_digest() == b.state_digest()
    assert a.scheduler.last_epoch == b.scheduler.last_epoch == 2


def test_generate_greedy_is_batch_invariant(model_dir: str) -> None:
    be = backend(model_dir, micro=4)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    together = be.generate(prompts, max_new_tokens=5)
    alone = [be.generate([p], max_new_tokens=5)[0] for p in prompts]
    assert together == alone  # left padding does not change what a row generates


def test_log_probs_match_the_sft_loss(model_dir: str) -> None:
    # -sum(log p) over trained tokens is the summed cross-entropy the SFT objective reports
    be = backend(model_dir, micro=3)
    b = batch()
    logp = be.log_probs(b)
    assert logp.shape == (8, 11)
    mask = b.tensors["loss_mask"][:, 1:].float()
    metrics = be.evaluate(b, sft)
    assert float(-(logp * mask).sum()) == pytest.approx(metrics["train/loss_sum"], rel=1e-5)
    assert metrics["train/loss_tokens"] == float(mask.sum())


def test_actor_train_lr_override_is_outside_the_schedule(model_dir: str) -> None:
    # The agentic warm start's `warm_start.lr`: one step at lr 0.5 while a linear schedule over
    # 3 steps says 1e-2, 5e-3, 0; the override neither uses nor advances it, so the next
    # steps are the schedule's first two.
    from roll_core.workers.actor_train import ActorTrain

    worker = ActorTrain(
        spec=TrainBackendSpec(
            model_path=model_dir,
            device="cpu",
            optim=OptimConfig(lr=1e-2, scheduler="linear"),
            total_steps=3,
            micro_batch_size=4,
            seed=0,
            num_threads=1,
        ),
    )
    worker.setup()
    before = {n: p.detach().clone() for n, p in worker.backend.model.named_parameters()}
    assert worker.train_step(batch(), "sft", lr=0.5)["train/lr"] == 0.5
    # Adam's first update moves every weight with a gradient by ~lr: 0.5, not 1e-2
    moved = max(
        float((p.detach() - before[n]).abs().max())
        for n, p in worker.backend.model.named_parameters()
    )
    assert moved == pytest.approx(0.5, rel=0.01)
    assert worker.backend.scheduler.last_epoch == 0
    assert worker.train_step(batch(), "sft")["train/lr"] == 1e-2
    assert worker.train_step(batch(), "sft")["train/lr"] == pytest.approx(5e-3)
    assert worker.backend.scheduler.last_epoch == 2


def test_token_log_probs_in_chunks_equal_one_pass(monkeypatch) -> None:
    """The log-prob pass turns a chunk of positions at a time into float32 (issue 32 item 7):
    each value is bit for bit the one-pass log softmax(logits / T) of the next token."""
    import roll_core.backends.train.torch_backend as tb

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11).to(torch.bfloat16)
    ids = torch.randint(0, 11, (3, 7))
    one_pass = torch.log_softmax(logits[:, :-1].float() / 0.7, dim=-1)
    expected = one_pass.gather(-1, ids[:, 1:, None]).squeeze(-1)
    monkeypatch.setattr(tb, "LOG_PROB_CHUNK", 3 * 2 * 11)  # 2 positions of 3 rows a chunk
    chunked = token_log_probs(logits, ids, temperature=0.7)
    assert chunked.dtype == torch.float32 and chunked.shape == (3, 6)
    assert torch.equal(chunked, expected)
    assert token_log_probs(logits[:, :1], ids[:, :1]).shape == (3, 0)  # nothing to predict
