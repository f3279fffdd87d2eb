"""Distillation divergences, temperature, top-k grouping and the `distill` objective, against
hand-computed numbers. Teacher p = [0.5, 0.5] and student q = [0.25, 0.75] throughout
(logits [0, 0] and [0, ln 3])."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms.distill import (
    DIVERGENCES,
    distill_loss,
    student_log_probs,
    teacher_targets,
)
from roll_core.data import Batch
from roll_core.workers.objectives import get_objective

P_LOGITS = torch.tensor([[0.0, 0.0]])
Q_LOGITS = torch.tensor([[0.0, math.log(3.0)]])


def _loss(kind: str, **kw: float) -> float:
    teacher_logp, ids = teacher_targets(P_LOGITS)
    losses, _ = distill_loss(Q_LOGITS, teacher_logp, ids, loss_type=kind, **kw)
    return float(losses)


def test_divergences_by_hand() -> None:
    # forward KL(p||q) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.346574 - 0.202733 = 0.143841
    assert _loss("forward_kl") == pytest.approx(0.143841, abs=1e-6)
    # reverse KL(q||p) = 0.25 ln(0.25/0.5) + 0.75 ln(0.75/0.5) = -0.173287 + 0.304099 = 0.130812
    assert _loss("reverse_kl") == pytest.approx(0.130812, abs=1e-6)
    # JSD, beta 0.5: m = [0.375, 0.625]; KL(p||m) = 0.5 ln(4/3) + 0.5 ln(0.8) = 0.032269,
    # KL(q||m) = 0.25 ln(2/3) + 0.75 ln(1.2) = 0.035375; 0.5 * (0.032269 + 0.035375) = 0.033822
    assert _loss("jsd", jsd_beta=0.5) == pytest.approx(0.033822, abs=1e-6)
    # skew forward, alpha 0.1: m = 0.1 p + 0.9 q = [0.275, 0.725];
    # KL(p||m) = 0.5 ln(0.5/0.275) + 0.5 ln(0.5/0.725) = 0.298918 - 0.185782 = 0.113137
    assert _loss("skew_forward_kl", skew_alpha=0.1) == pytest.approx(0.113137, abs=1e-6)
    # skew reverse, alpha 0.1: m = 0.1 q + 0.9 p = [0.475, 0.525];
    # KL(q||m) = 0.25 ln(0.25/0.475) + 0.75 ln(0.75/0.525) = -0.160464 + 0.267506 = 0.107043
    assert _loss("skew_reverse_kl", skew_alpha=0.1) == pytest.approx(0.107043, abs=1e-6)
    assert DIVERGENCES.names() == [
        "forward_kl",
        "reverse_kl",
        "jsd",
        "skew_forward_kl",
        "skew_reverse_kl",
    ]


def test_temperature_softens_both_and_scales_by_tau_squared() -> None:
    # tau = 2: p stays [0.5, 0.5]; q = softmax([0, ln 3 / 2]) = [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    # = [0.366025, 0.633975]; KL(p||q) = 0.5 ln(0.5/0.366025) + 0.5 ln(0.5/0.633975)
    # = 0.155953 - 0.118700 = 0.037252; times tau^2 = 4: 0.149009.
    teacher_logp, _ = teacher_targets(P_LOGITS, temperature=2.0)
    losses, kl = distill_loss(Q_LOGITS, teacher_logp, loss_type="forward_kl", temperature=2.0)
    assert float(losses) == pytest.approx(0.149009, abs=1e-6)
    assert float(kl) == pytest.approx(0.037252, abs=1e-6)  # the metric has no tau^2


def test_forward_kl_gradient_is_q_minus_p() -> None:
    # d KL(p || softmax(z)) / dz = softmax(z) - p = [0.25, 0.75] - [0.5, 0.5] = [-0.25, 0.25]
    z = Q_LOGITS.clone().requires_grad_(True)
    teacher_logp, _ = teacher_targets(P_LOGITS)
    losses, _ = distill_loss(z, teacher_logp, loss_type="forward_kl")
    losses.sum().backward()
    torch.testing.assert_close(z.grad, torch.tensor([[-0.25, 0.25]]), atol=1e-6, rtol=0)


def test_top_k_groups_the_tail_and_bounds_the_full_kl() -> None:
    # Teacher p = [0.5, 0.25, 0.125, 0.125]; top-2 -> [ln 0.5, ln 0.25, ln(0.25)] (tail 0.25).
    p = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    logp, ids = teacher_targets(p, top_k=2)
    assert ids is not None and ids.tolist() == [[0, 1]]
    torch.testing.assert_close(logp.exp(), torch.tensor([[0.5, 0.25, 0.25]]))
    # Student uniform: grouped [0.25, 0.25, 0.5]. KL = 0.5 ln 2 + 0.25 ln 1 + 0.25 ln 0.5
    # = 0.25 ln 2 = 0.173287, equal to the full KL (inside the tail q/p is constant).
    uniform = torch.zeros(1, 4)
    grouped = student_log_probs(uniform, ids)
    torch.testing.assert_close(grouped.exp(), torch.tensor([[0.25, 0.25, 0.5]]))
    top, _ = distill_loss(uniform, logp, ids, loss_type="forward_kl")
    full, _ = distill_loss(uniform, torch.log_softmax(p, -1), None, loss_type="forward_kl")
    assert float(top) == pytest.approx(0.25 * math.log(2), abs=1e-6)
    assert float(full) == pytest.approx(0.25 * math.log(2), abs=1e-6)
    # Student q = [0.25, 0.25, 0.4, 0.1]: grouped KL is still 0.25 ln 2 = 0.173287, while the
    # full KL adds the tail's inner mismatch: 0.125 ln(0.125/0.4) + 0.125 ln(0.125/0.1)
    # = -0.145394 + 0.027893 -> full = 0.5 ln 2 + 0 - 0.145394 + 0.027893 = 0.229073 >= 0.173287.
    q = torch.log(torch.tensor([[0.25, 0.25, 0.4, 0.1]]))
    top, _ = distill_loss(q, logp, ids, loss_type="forward_kl")
    full, _ = distill_loss(q, torch.log_softmax(p, -1), None, loss_type="forward_kl")
    assert float(top) == pytest.approx(0.173287, abs=1e-6)
    assert float(full) == pytest.approx(0.229073, abs=1e-6)


def test_distill_objective_masks_normalises_and_counts_agreement() -> None:
    # Two rows of 3 tokens, vocab 2 (+1 padding logit that must be dropped). Trained targets:
    # row 0 position 1 and row 1 positions 0 and 1 -> 3 tokens; global loss_tokens = 6
    # (as if another micro-batch held 3 more). The student's logits are [0, ln 3] everywhere
    # (q = [0.25, 0.75], argmax 1); the teacher is p = [0.5, 0.5] with top-1 token 0.
    # Loss per token 0.143841 (forward KL above); share = 3 * 0.143841 / 6 = 0.071921.
    logits = torch.tensor([0.0, math.log(3.0), 50.0]).expand(2, 3, 3).clone()
    teacher_logp = torch.full((2, 2, 2), math.log(0.5))
    mb = Batch(
        tensors={
            "input_ids": torch.zeros(2, 3, dtype=torch.long),
            "attention_mask": torch.ones(2, 3, dtype=torch.long),
            "loss_mask": torch.tensor([[0, 0, 1], [0, 1, 1]]),
            "teacher_logprobs": teacher_logp,
            "teacher_top1": torch.zeros(2, 2, dtype=torch.long),
        },
        meta={"loss_tokens": 6},
    )
    loss, metrics = get_objective("distill", loss_type="forward_kl", vocab_size=2)(logits, mb)
    assert float(loss) == pytest.approx(3 * 0.143841 / 6, abs=1e-6)
    assert metrics["distill/tokens"] == 3.0
    assert metrics["distill/kl_sum"] == pytest.approx(3 * 0.143841, abs=1e-5)
    assert metrics["distill/agree_sum"] == 0.0  # student argmax 1, teacher top-1 0


def test_bad_parameters() -> None:
    teacher_logp, _ = teacher_targets(P_LOGITS)
    with pytest.raises(ValueError, match="skew_alpha"):
        distill_loss(Q_LOGITS, teacher_logp, loss_type="skew_forward_kl", skew_alpha=1.0)
    with pytest.raises(ValueError, match="temperature"):
        teacher_targets(P_LOGITS, temperature=0.0)
    with pytest.raises(ValueError, match="shape"):
        distill_loss(torch.zeros(1, 3), teacher_logp, loss_type="forward_kl")
