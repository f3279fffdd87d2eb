"""DPO / IPO / cDPO losses and the `dpo` objective, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms.preference import PREFERENCE_LOSSES, chosen_nll, preference_loss
from roll_core.data import Batch
from roll_core.errors import ConfigError
from roll_core.workers.objectives import get_objective

LOG2 = math.log(2.0)  # 0.693147...


def _grads(loss_type: str, beta: float, label_smoothing: float = 0.0):
    """Loss and d loss / d policy log-probs at initialisation (policy == reference)."""
    pc = torch.tensor([-2.0], requires_grad=True)
    pr = torch.tensor([-3.0], requires_grad=True)
    out = preference_loss(
        pc,
        pr,
        torch.tensor([-2.0]),
        torch.tensor([-3.0]),
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
    )
    out.losses.sum().backward()
    return out._replace(losses=out.losses.detach()), float(pc.grad), float(pr.grad)


def test_dpo_gradient_at_initialisation() -> None:
    # h = (logpi_c - logref_c) - (logpi_r - logref_r) = 0 at init.
    # L = -log sigmoid(beta h) = log 2;  dL/dh = -beta sigmoid(-beta h) = -0.1 * 0.5 = -0.05
    # dh/dlogpi_c = 1, dh/dlogpi_r = -1  ->  grads -0.05 (chosen), +0.05 (rejected).
    out, g_chosen, g_rejected = _grads("sigmoid", beta=0.1)
    assert float(out.losses) == pytest.approx(LOG2, abs=1e-7)
    assert g_chosen == pytest.approx(-0.05, abs=1e-7)
    assert g_rejected == pytest.approx(0.05, abs=1e-7)
    assert float(out.chosen_rewards) == 0.0 and float(out.rejected_rewards) == 0.0


def test_ipo_and_cdpo_gradients_at_initialisation() -> None:
    # IPO: L = (h - 1/(2 beta))^2 = (0 - 5)^2 = 25;  dL/dh = 2 (h - 5) = -10.
    out, g_chosen, g_rejected = _grads("ipo", beta=0.1)
    assert float(out.losses) == pytest.approx(25.0)
    assert (g_chosen, g_rejected) == (pytest.approx(-10.0), pytest.approx(10.0))
    # cDPO, eps = 0.1: L = -(0.9) log sig(0) - 0.1 log sig(0) = log 2;
    # dL/dh = -0.9 beta sig(-beta h) + 0.1 beta sig(beta h) = -0.045 + 0.005 = -0.04.
    out, g_chosen, g_rejected = _grads("cdpo", beta=0.1, label_smoothing=0.1)
    assert float(out.losses) == pytest.approx(LOG2, abs=1e-7)
    assert (g_chosen, g_rejected) == (pytest.approx(-0.04), pytest.approx(0.04))


def test_losses_and_rewards_away_from_initialisation() -> None:
    # beta 0.5; chosen log-ratio -1 - (-2) = 1, rejected -3 - (-2) = -1; h = 2, beta h = 1.
    args = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]))
    sig = preference_loss(*args, loss_type="sigmoid", beta=0.5)
    # -log sigmoid(1) = log(1 + e^-1) = 0.3132617
    assert float(sig.losses) == pytest.approx(0.3132617, abs=1e-6)
    # rewards beta * log-ratio: 0.5 * 1 and 0.5 * -1
    assert float(sig.chosen_rewards) == 0.5 and float(sig.rejected_rewards) == -0.5
    # IPO: (h - 1/(2*0.5))^2 = (2 - 1)^2 = 1
    assert float(preference_loss(*args, loss_type="ipo", beta=0.5).losses) == pytest.approx(1.0)
    # cDPO eps 0.2: 0.8 * log(1 + e^-1) + 0.2 * log(1 + e) = 0.2506094 + 0.2626523 = 0.5132617
    cdpo = preference_loss(*args, loss_type="cdpo", beta=0.5, label_smoothing=0.2)
    assert float(cdpo.losses) == pytest.approx(0.5132617, abs=1e-6)


def test_bad_parameters() -> None:
    t = torch.zeros(1)
    with pytest.raises(ConfigError, match="unknown preference loss 'dop'"):
        preference_loss(t, t, t, t, loss_type="dop")
    with pytest.raises(ValueError, match="beta"):
        preference_loss(t, t, t, t, beta=0.0)
    with pytest.raises(ValueError, match="cdpo"):
        preference_loss(t, t, t, t, loss_type="sigmoid", label_smoothing=0.1)
    assert PREFERENCE_LOSSES.names() == ["sigmoid", "cdpo", "ipo"]


def test_dpo_objective_gradient_on_logits_at_initialisation() -> None:
    # One pair with one-token responses over a vocabulary of 2; all logits 0, so each response
    # has log-prob log(1/2), equal to the reference's: h = 0, loss = log 2.
    # dL/dlogp_chosen = -beta/2 = -0.05, dL/dlogp_rejected = +0.05 (beta = 0.1), and
    # dlogp(token)/dlogits = onehot(token) - softmax = onehot(token) - [0.5, 0.5]:
    #   chosen  (token 0): -0.05 * [ 0.5, -0.5] = [-0.025,  0.025]
    #   rejected (token 1): 0.05 * [-0.5,  0.5] = [-0.025,  0.025]
    # The logits at the last position predict nothing: gradient 0.
    logits = torch.zeros(2, 2, 2, requires_grad=True)
    mb = Batch(
        tensors={
            "input_ids": torch.tensor([[1, 0], [1, 1]]),
            "attention_mask": torch.ones(2, 2, dtype=torch.long),
            "loss_mask": torch.tensor([[0, 1], [0, 1]]),
            "pair_side": torch.tensor([0, 1]),
            "ref_logps": torch.full((2,), -LOG2),
        },
        meta={"pairs": 1},
    )
    loss, metrics = get_objective("dpo", loss_type="sigmoid", beta=0.1)(logits, mb)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(LOG2, abs=1e-6)
    expected = torch.tensor([[[-0.025, 0.025], [0.0, 0.0]], [[-0.025, 0.025], [0.0, 0.0]]])
    torch.testing.assert_close(logits.grad, expected, atol=1e-7, rtol=0)
    assert metrics["dpo/pairs"] == 1.0 and metrics["dpo/accuracy_sum"] == 0.0


def test_dpo_objective_normalises_by_global_pairs_and_checks_layout() -> None:
    # Two micro-batches of one pair each, global pairs = 2: each returns half its pair loss.
    logits = torch.zeros(2, 2, 2)
    mb = Batch(
        tensors={
            "input_ids": torch.tensor([[1, 0], [1, 1]]),
            "attention_mask": torch.ones(2, 2, dtype=torch.long),
            "loss_mask": torch.tensor([[0, 1], [0, 1]]),
            "pair_side": torch.tensor([0, 1]),
            "ref_logps": torch.full((2,), -LOG2),
        },
        meta={"pairs": 2},
    )
    loss, _ = get_objective("dpo", beta=0.1)(logits, mb)
    assert float(loss) == pytest.approx(LOG2 / 2, abs=1e-6)
    swapped = Batch(tensors={**mb.tensors, "pair_side": torch.tensor([1, 0])}, meta=mb.meta)
    with pytest.raises(ValueError, match="whole pairs"):
        get_objective("dpo", beta=0.1)(logits, swapped)


def test_rpo_term_adds_the_chosen_token_mean_nll() -> None:
    # chosen log-prob -3 over 2 tokens: NLL per token 1.5
    assert chosen_nll(torch.tensor([-3.0]), torch.tensor([2])).tolist() == [1.5]
    # The objective above with sft_weight 0.5: loss = log 2 + 0.5 * log 2 = 1.039721 (one
    # one-token chosen response with log-prob -log 2). d loss / d logp_chosen = -0.05 - 0.5 =
    # -0.55, so the chosen row's logits get -0.55 * [0.5, -0.5] = [-0.275, 0.275]; the rejected
    # row's gradient is unchanged, [-0.025, 0.025].
    logits = torch.zeros(2, 2, 2, requires_grad=True)
    mb = Batch(
        tensors={
            "input_ids": torch.tensor([[1, 0], [1, 1]]),
            "attention_mask": torch.ones(2, 2, dtype=torch.long),
            "loss_mask": torch.tensor([[0, 1], [0, 1]]),
            "pair_side": torch.tensor([0, 1]),
            "ref_logps": torch.full((2,), -LOG2),
        },
        meta={"pairs": 1},
    )
    loss, metrics = get_objective("dpo", beta=0.1, sft_weight=0.5)(logits, mb)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(1.5 * LOG2, abs=1e-6)
    assert metrics["dpo/nll_sum"] == pytest.approx(LOG2, abs=1e-6)
    expected = torch.tensor([[[-0.275, 0.275], [0.0, 0.0]], [[-0.025, 0.025], [0.0, 0.0]]])
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=0)
