"""On-policy distillation advantages, with hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from roll_core.algorithms.on_policy_distill import on_policy_distill_advantages

# Two responses; row 0 has 3 response tokens, row 1 has 2 then padding.
TEACHER = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.2, -3.0, -9.0, -9.0]])
STUDENT = torch.tensor([[-2.0, -0.5, -1.0, 0.0], [-0.7, -1.0, -1.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_token_mode_is_teacher_minus_student_per_token() -> None:
    adv, m = on_policy_distill_advantages(
        teacher_log_probs=TEACHER, student_log_probs=STUDENT, response_mask=MASK
    )
    # row 0: -1-(-2)=1, -0.5-(-0.5)=0, -2-(-1)=-1 ; row 1: -0.2-(-0.7)=0.5, -3-(-1)=-2
    assert adv.tolist() == [[1.0, 0.0, -1.0, 0.0], [0.5, -2.0, 0.0, 0.0]]
    # reverse KL (student - teacher) over the 5 tokens: (-1 + 0 + 1 - 0.5 + 2) / 5 = 0.3
    assert m["distill/reverse_kl"] == pytest.approx(0.3)
    # teacher log-prob mean: (-1 - 0.5 - 2 - 0.2 - 3) / 5 = -1.34
    assert m["distill/teacher_log_prob"] == pytest.approx(-1.34)
    assert m["distill/kl_advantage_abs_max"] == 2.0


def test_padding_never_leaks_even_with_huge_values_there() -> None:
    teacher = TEACHER.clone()
    teacher[1, 2:] = -1e9  # padding positions hold garbage
    adv, m = on_policy_distill_advantages(
        teacher_log_probs=teacher, student_log_probs=STUDENT, response_mask=MASK
    )
    assert adv[1, 2:].tolist() == [0.0, 0.0]
    assert m["distill/reverse_kl"] == pytest.approx(0.3)


def test_sequence_mode_spreads_each_response_mean() -> None:
    adv, _ = on_policy_distill_advantages(
        teacher_log_probs=TEACHER, student_log_probs=STUDENT, response_mask=MASK, mode="sequence"
    )
    # row 0 mean (1 + 0 - 1) / 3 = 0 ; row 1 mean (0.5 - 2) / 2 = -0.75
    assert adv.tolist() == [[0.0, 0.0, 0.0, 0.0], [-0.75, -0.75, 0.0, 0.0]]


def test_coef_clip_and_mixing_with_the_task_advantage() -> None:
    task = torch.tensor([[2.0, 2.0, 2.0, 2.0], [-1.0, -1.0, -1.0, -1.0]])
    adv, m = on_policy_distill_advantages(
        teacher_log_probs=TEACHER,
        student_log_probs=STUDENT,
        response_mask=MASK,
        coef=0.5,
        clip=1.5,
        task_advantages=task,
        reward_weight=0.25,
    )
    # kl terms clipped to [-1.5, 1.5]: [1, 0, -1], [0.5, -1.5]; times 0.5: [.5, 0, -.5], [.25, -.75]
    # plus 0.25 x task: +0.5 on row 0, -0.25 on row 1; padding stays 0
    assert adv.tolist() == [[1.0, 0.5, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0]]
    assert m["distill/kl_advantage_abs_max"] == 0.75
    # the metric reports the unclipped divergence
    assert m["distill/reverse_kl"] == pytest.approx(0.3)


def test_zero_reward_weight_ignores_the_task_advantage() -> None:
    task = torch.full((2, 4), float("nan"))
    adv, _ = on_policy_distill_advantages(
        teacher_log_probs=TEACHER, student_log_probs=STUDENT, response_mask=MASK,
        task_advantages=task, reward_weight=0.0,
    )  # fmt: skip
    assert not adv.isnan().any()


def test_fully_masked_rows_and_batches_give_zeros() -> None:
    mask = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    for mode in ("token", "sequence"):
        adv, m = on_policy_distill_advantages(
            teacher_log_probs=TEACHER, student_log_probs=STUDENT, response_mask=mask, mode=mode
        )
        assert adv.tolist() == [[0.0] * 4, [0.5, 0.0, 0.0, 0.0]]
        assert m["distill/reverse_kl"] == pytest.approx(-0.5)
    adv, m = on_policy_distill_advantages(
        teacher_log_probs=TEACHER, student_log_probs=STUDENT, response_mask=torch.zeros(2, 4)
    )
    assert adv.abs().sum() == 0 and m["distill/reverse_kl"] == 0.0


def test_identical_teacher_and_student_give_zero_advantage() -> None:
    adv, m = on_policy_distill_advantages(
        teacher_log_probs=STUDENT, student_log_probs=STUDENT, response_mask=MASK
    )
    assert adv.abs().sum() == 0 and m["distill/reverse_kl"] == 0.0


def test_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="token, sequence"):
        on_policy_distill_advantages(
            teacher_log_probs=TEACHER, student_log_probs=STUDENT, response_mask=MASK, mode="tok"
        )


def test_the_grpo_presets_loss_turns_each_advantage_into_its_gradient() -> None:
    """What the `grpo` preset does with the distillation advantage (token mode): one update on
    fresh samples, so the PPO ratio is exactly 1 and its clip never binds (the loss is the
    plain policy gradient / importance-sampling loss of the sources), and seq-mean-token-mean
    divides token t of response i by (tokens of i) x (responses). No group normalisation."""
    from roll_core.algorithms.policy_losses import policy_loss

    student = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    teacher = torch.tensor([[-3.0, -1.0], [-4.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, _ = on_policy_distill_advantages(
        teacher_log_probs=teacher, student_log_probs=student, response_mask=mask
    )
    # calc: A = teacher - student = [[-2, +1], [-4, 0 (padding)]]
    assert adv.tolist() == [[-2.0, 1.0], [-4.0, 0.0]]
    log_probs = student.clone().requires_grad_(True)
    loss, metrics = policy_loss("ppo", log_probs=log_probs, old_log_probs=student,
                                advantages=adv, response_mask=mask,
                                agg_mode="seq-mean-token-mean", clip_low=0.2, clip_high=0.2)  # fmt: skip
    loss.backward()
    # calc: d loss / d logp = -A / (len_i * 2): row 0: 2/4 = 0.5, -1/4 = -0.25; row 1: 4/2 = 2
    # (a gradient step lowers the log-prob of the tokens the teacher finds less likely)
    assert log_probs.grad.tolist() == [[0.5, -0.25], [2.0, 0.0]]
    # calc: loss = -(mean(-2, 1) + mean(-4)) / 2 = -(-0.5 - 4) / 2 = 2.25
    assert float(loss.detach()) == pytest.approx(2.25)
    assert metrics["actor/clipfrac"] == 0.0


def test_full_mode_is_the_exact_reverse_kl_of_the_distributions() -> None:
    from roll_core.algorithms.on_policy_distill import full_divergence

    # student q = softmax([0, 0]) = [0.5, 0.5]; teacher p = [0.9, 0.1]
    logits = torch.zeros(1, 2, requires_grad=True)
    teacher = torch.tensor([[0.9, 0.1]]).log()
    kl = full_divergence(logits, teacher, vocab_size=2)
    # calc: 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5 (-0.587787) + 0.5 (1.609438) = 0.510826
    assert float(kl.detach()) == pytest.approx(0.510826, abs=1e-6)
    kl.sum().backward()
    # calc: dKL/dz_i = q_i (ln(q_i/p_i) - KL): 0.5 (-0.587787 - 0.510826) = -0.549306, +0.549306
    assert logits.grad.tolist()[0] == pytest.approx([-0.549306, 0.549306], abs=1e-6)
    # the student's logits beyond the shared vocabulary (here id 2) are dropped
    wide = torch.tensor([[0.0, 0.0, 5.0]])
    assert float(full_divergence(wide, teacher, vocab_size=2)) == pytest.approx(0.510826, abs=1e-6)
    # divergence forward_kl: KL(p || q) = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.529008 - 0.160944
    forward = full_divergence(wide, teacher, vocab_size=2, divergence="forward_kl")
    assert float(forward) == pytest.approx(0.368064, abs=1e-6)


def test_full_mode_with_top_k_groups_the_students_tail_like_the_teachers() -> None:
    from roll_core.algorithms.on_policy_distill import full_divergence

    # student q = [0.5, 0.3, 0.2]; the teacher's top 1 is token 0 (0.8), tail bucket 0.2
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    teacher = torch.tensor([[0.8, 0.2]]).log()
    kl = full_divergence(logits, teacher, torch.tensor([[0]]), vocab_size=3)
    # calc: grouped q = [0.5, 0.5]: 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = -0.235002 + 0.458145
    assert float(kl) == pytest.approx(0.223144, abs=1e-6)


# Logits 6 wide, tokenizer vocabulary 4: ids 4 and 5 are embedding padding with large logits
# (5.0: they would hold 99.7% of the student's softmax over all 6). Over the 4 tokens the
# student is q = [0.5, 0.3, 0.1, 0.1], the teacher p = [0.6, 0.2, 0.15, 0.05].
PADDED_STUDENT = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
PADDED_STUDENT = torch.cat([PADDED_STUDENT, torch.tensor([[5.0, 5.0]])], dim=-1)
PADDED_TEACHER = torch.cat(
    [torch.tensor([[0.6, 0.2, 0.15, 0.05]]).log(), torch.tensor([[9.0, 9.0]])], -1
)


def _padded_divergence(top_k: int | None, divergence: str = "reverse_kl") -> float:
    from roll_core.algorithms.distill import teacher_targets
    from roll_core.algorithms.on_policy_distill import full_divergence

    # the teacher's side, as Reference.distributions does it: cut to the vocabulary first
    teacher, ids = teacher_targets(PADDED_TEACHER[:, :4], top_k=top_k)
    return float(full_divergence(PADDED_STUDENT, teacher, ids, vocab_size=4, divergence=divergence))


def test_full_mode_cuts_the_students_padding_rows_with_top_k_too() -> None:
    # calc, top 2 (ids 0, 1): grouped q = [0.5, 0.3, 0.2], p = [0.6, 0.2, 0.2]:
    # 0.5 ln(0.5/0.6) + 0.3 ln(0.3/0.2) + 0.2 ln(1) = -0.091161 + 0.121640 = 0.030479
    # (with the padding rows in the student's tail: q = [0.0017, 0.0010, 0.9973], about 5.6)
    assert _padded_divergence(2) == pytest.approx(0.030479, abs=1e-6)
    # calc, full: -0.091161 + 0.121640 + 0.1 ln(0.1/0.15) + 0.1 ln(0.1/0.05)
    #           = -0.091161 + 0.121640 - 0.040547 + 0.069315 = 0.059247
    assert _padded_divergence(None) == pytest.approx(0.059247, abs=1e-6)
    # top 3 = V - 1: the tail is token 3 alone, so the grouping loses nothing
    assert _padded_divergence(3) == pytest.approx(0.059247, abs=1e-6)
    # forward KL: 0.6 ln(0.6/0.5) + 0.2 ln(0.2/0.3) + 0.15 ln(0.15/0.1) + 0.05 ln(0.05/0.1)
    #           = 0.109393 - 0.081093 + 0.060820 - 0.034657 = 0.054462
    assert _padded_divergence(3, "forward_kl") == pytest.approx(0.054462, abs=1e-6)


def test_full_mode_top_k_equals_roll_distills_loss_on_the_same_logits() -> None:
    from roll_core.algorithms.distill import distill_loss, teacher_targets
    from roll_core.algorithms.on_policy_distill import full_divergence

    gen = torch.Generator().manual_seed(0)
    student, teacher_logits = torch.randn(2, 5, 320, generator=gen).unbind(0)
    student[:, 259:] += 4.0  # padding rows the untrained model gives much mass
    for loss in ("reverse_kl", "forward_kl", "jsd"):
        teacher, ids = teacher_targets(teacher_logits[:, :259], top_k=8)
        on_policy = full_divergence(student, teacher, ids, vocab_size=259, divergence=loss)
        # roll distill: the student cut to the vocabulary by its objective, tau = 1
        offline, _ = distill_loss(student[:, :259], teacher, ids, loss_type=loss)
        assert torch.allclose(on_policy, offline, atol=1e-6), loss


def test_full_mode_refuses_a_vocabulary_that_does_not_fit() -> None:
    from roll_core.algorithms.on_policy_distill import full_divergence

    with pytest.raises(ValueError, match="does not fit the student's 6 logits"):
        full_divergence(PADDED_STUDENT, PADDED_TEACHER, vocab_size=7)
    with pytest.raises(ValueError, match="have 6 entries, not the vocabulary's 4"):
        full_divergence(PADDED_STUDENT, PADDED_TEACHER, vocab_size=4)


def test_full_mode_puts_no_reverse_kl_into_the_advantages() -> None:
    adv, metrics = on_policy_distill_advantages(
        teacher_log_probs=TEACHER, student_log_probs=STUDENT, response_mask=MASK, mode="full"
    )
    assert adv.abs().sum() == 0
    # the sampled reverse KL is still logged: (-1 + 0 + 1 - 0.5 + 2) / 5 = 0.3
    assert metrics["distill/reverse_kl"] == pytest.approx(0.3)
    task = torch.ones_like(MASK)
    mixed, _ = on_policy_distill_advantages(
        teacher_log_probs=TEACHER, student_log_probs=STUDENT, response_mask=MASK, mode="full",
        task_advantages=task, reward_weight=0.5,
    )  # fmt: skip
    assert mixed.tolist() == (0.5 * MASK).tolist()
