"""The critic (value model of PPO): value positions, the clipped value loss of a micro-batch,
explained variance, training towards returns, and an exact save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roll_core.algorithms import explained_variance
from roll_core.config.schema import OptimConfig
from roll_core.data import Batch
from roll_core.errors import CheckpointError
from roll_core.models import load_causal_lm, materialize_builtin
from roll_core.workers.critic import Critic, ValueModel, critic_loss


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("cache")))


def test_critic_loss_by_hand() -> None:
    # token 0: V=0.5, V_old=0.3 (moved 0.2: inside the clip), R=1 -> (0.5-1)^2 = 0.25 both ways
    # token 1: V=1.0, V_old=0.3, R=2 -> unclipped (1-2)^2 = 1; clipped V=0.5 -> (0.5-2)^2 = 2.25
    #          the max is the clipped one (clipfrac counts it) and its gradient is 0
    # token 2: padding (R=9 must not count)
    values = torch.tensor([[0.5, 1.0, 0.0]], requires_grad=True)
    mb = Batch(
        tensors={
            "values": torch.tensor([[0.3, 0.3, 0.0]]),
            "returns": torch.tensor([[1.0, 2.0, 9.0]]),
            "response_mask": torch.tensor([[1.0, 1.0, 0.0]]),
        },
        meta={"response_tokens": 4.0},  # the mini-batch has 4 tokens, this micro-batch 2
    )
    loss, metrics = critic_loss(values, mb, clip=0.2)
    # 0.5 * (0.25 + 2.25) / 4 tokens of the mini-batch
    assert loss.item() == pytest.approx(0.3125)
    assert metrics["critic/value_loss"] == pytest.approx(0.3125)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(0.5 * 2 / 4)  # share-weighted
    assert metrics["critic/vpred_mean"] == pytest.approx(0.75 * 2 / 4)
    loss.backward()
    # d/dV0 of 0.5 * (V0 - 1)^2 / 4 = (0.5 - 1) / 4; the clipped token and padding get none
    assert values.grad is not None
    assert torch.allclose(values.grad, torch.tensor([[-0.125, 0.0, 0.0]]))


def test_critic_loss_without_clip_is_squared_error() -> None:
    values = torch.tensor([[1.0, 3.0]])
    mb = Batch(
        tensors={
            "values": torch.zeros(1, 2),
            "returns": torch.tensor([[0.0, 1.0]]),
            "response_mask": torch.ones(1, 2),
        },
        meta={"response_tokens": 2.0},
    )
    loss, metrics = critic_loss(values, mb, clip=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)  # 1.25
    assert metrics["critic/vf_clipfrac"] == 0.0


def test_explained_variance_by_hand() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    values = torch.tensor([[1.0, 2.0, 4.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # Var(returns) over 3 tokens (unbiased) = 1; returns - values = [0, 0, -1]:
    # mean -1/3, squares (1/9 + 1/9 + 4/9) = 2/3, / 2 = 1/3  ->  1 - 1/3 = 2/3
    ev = explained_variance(values=values, returns=returns, response_mask=mask)
    assert ev.item() == pytest.approx(2 / 3)
    assert explained_variance(values=returns, returns=returns, response_mask=mask).item() == 1.0
    flat = torch.ones(1, 4)
    assert explained_variance(values=values, returns=flat, response_mask=mask).item() == 0.0


def test_value_positions_are_the_log_prob_positions(model_path: str) -> None:
    """values[:, t] sees tokens 0..t only (the state in which token t+1 is generated)."""
    torch.manual_seed(0)
    model = ValueModel(load_causal_lm(model_path))
    ids = torch.randint(0, 200, (1, 8))
    attn = torch.ones_like(ids)
    assert torch.equal(model(ids, attn), torch.zeros(1, 8))  # zero-initialised head
    torch.nn.init.normal_(model.value_head.weight)
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % 200
    a, b = model(ids, attn)[:, :-1], model(changed, attn)[:, :-1]  # target space [B, T-1]
    assert torch.allclose(a[:, :5], b[:, :5])  # positions 0..4 do not see token 5
    assert not torch.allclose(a[:, 5:], b[:, 5:])  # position 5 on do


def _critic(model_path: str, lr: float = 1e-2) -> Critic:
    critic = Critic(
        model_path=model_path,
        optim=OptimConfig(lr=lr, scheduler="constant"),
        total_steps=100,
        micro_batch_size=2,  # accumulation over 2 micro-batches
        device="cpu",
        num_threads=1,
        value_clip=None,
    )
    critic.setup()
    return critic


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (4, 10), generator=gen)
    attn = torch.ones_like(ids)
    attn[3, 8:] = 0  # right padding
    mask = torch.zeros(4, 9)
    mask[:, 5:] = 1
    mask[3, 7:] = 0
    returns = torch.where(torch.arange(4)[:, None] % 2 == 0, 1.0, -1.0) * mask
    return Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
            "response_mask": mask,
            "returns": returns,
        },
        meta={"response_tokens": float(mask.sum())},
    )


def test_critic_learns_the_returns(model_path: str) -> None:
    critic = _critic(model_path)
    batch = _batch()
    losses = []
    for _ in range(15):
        batch.tensors["values"] = critic.values(batch)
        metrics = critic.train_step(batch)
        losses.append(metrics["critic/value_loss"])
    assert losses[0] == pytest.approx(0.5)  # values start at 0, returns are +-1
    assert losses[-1] < 0.1 * losses[0]
    mask = batch.tensors["response_mask"]
    ev = explained_variance(
        values=critic.values(batch), returns=batch.tensors["returns"], response_mask=mask
    )
    assert ev.item() > 0.8


def test_critic_save_load_is_exact(model_path: str, tmp_path: Path) -> None:
    batch = _batch()

    def step(critic: Critic) -> dict[str, float]:
        batch.tensors["values"] = critic.values(batch)
        return critic.train_step(batch)

    a = _critic(model_path)
    step(a)
    a.save(str(tmp_path / "critic"))
    after_a = step(a)
    b = _critic(model_path)
    b.load(str(tmp_path / "critic"))
    after_b = step(b)
    assert a.state_digest() == b.state_digest()  # weights + Adam moments + LR restored
    assert after_a["critic/value_loss"] == after_b["critic/value_loss"]
    with pytest.raises(CheckpointError):
        b.load(str(tmp_path / "missing"))
