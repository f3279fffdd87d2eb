"""On-policy distillation's `mode: full` loss (the `rl` objective) and `roll distill`'s (the
`distill` objective) on the built-in tiny model's logits (CPU, a few seconds).

The tiny model's output layer has 320 rows for its tokenizer's 259 tokens; untrained, it puts
a large share of its mass on the 61 padding rows. Both objectives cut the student to the
tokenizer's vocabulary before the softmax and the top-k tail, as the teachers cut theirs, so
`top_k = V - 1` (a tail of one token: nothing lost) gives the full divergence, and the two
objectives give the same loss and gradient on the same logits and teacher targets.
"""

from __future__ import annotations

import pytest
import torch

from roll_core.algorithms.distill import teacher_targets
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.data import Batch
from roll_core.models import load_causal_lm, load_tokenizer
from roll_core.models.builtin import materialize_builtin
from roll_core.pipelines.rl_iteration import mini_batch_meta
from roll_core.workers.objectives import rl
from roll_core.workers.preference_objectives import distill

STUDENT_TEXT = "What is 84 + 76? 160"
TEACHER_TEXT = "What is 12 - 70? -58"  # as long: its logits x 10 stand in for a sharp teacher


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.Tensor, ...]:
    """(input ids [1, T], the student's logits [1, T, 320], teacher logits [1, T, 320]) of the
    untrained builtin:tiny-qwen3 (nearly uniform: the teacher's are sharpened 10 times), and
    its tokenizer's size."""
    path = materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("models"))
    tok = load_tokenizer(str(path))
    model = load_causal_lm(str(path), device=torch.device("cpu"), dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(STUDENT_TEXT)])
    teacher_ids = torch.tensor([tok.encode(TEACHER_TEXT)])
    with torch.no_grad():
        return ids, model(ids).logits, 10 * model(teacher_ids).logits, len(tok)


def _rl_loss(logits, ids, logp, top, *, top_k, vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rl` objective (pure distillation: advantages 0) on every target position."""
    algo = AlgorithmConfig.model_validate(
        {
            "preset": "grpo",
            "kl": {"coef": 0.0},
            "on_policy_distill": {"teacher": {"path": "t"}, "mode": "full", "top_k": top_k},
        }
    )
    shape = ids[:, 1:].shape
    tensors = {"input_ids": ids, "response_mask": torch.ones(shape), "teacher_dist_logprobs": logp}
    tensors |= {"advantages": torch.zeros(shape), "behaviour_log_probs": torch.zeros(shape)}
    if top is not None:
        tensors["teacher_dist_ids"] = top
    batch = Batch(tensors=tensors)
    batch.meta = mini_batch_meta(batch, max_response_length=shape[1])
    leaf = logits.clone().requires_grad_()
    loss, _ = rl(leaf, batch, algorithm=algo, vocab_size=vocab)
    loss.backward()
    return loss.detach(), leaf.grad


def _distill_loss(logits, ids, logp, top, *, vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """`roll distill`'s objective, reverse KL at temperature 1, on the same positions."""
    tensors = {"input_ids": ids, "loss_mask": torch.ones(ids.shape), "teacher_logprobs": logp}
    tensors["loss_mask"][:, 0] = 0
    tensors["teacher_top1"] = logp.argmax(-1) if top is None else top[..., 0]
    if top is not None:
        tensors["teacher_ids"] = top
    batch = Batch(tensors=tensors, meta={"loss_tokens": ids.shape[1] - 1})
    leaf = logits.clone().requires_grad_()
    loss, _ = distill(leaf, batch, loss_type="reverse_kl", vocab_size=vocab)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("top_k", [None, 8, 258])
def test_rl_and_distill_objectives_agree_on_the_tiny_models_widths(tiny, top_k) -> None:
    ids, student, teacher, vocab = tiny
    assert (student.shape[-1], vocab) == (320, 259)  # 61 padding rows
    padding_mass = student.softmax(-1)[..., vocab:].sum(-1)
    assert float(padding_mass.min()) > 0.05  # the untrained model: a share the tail would take
    logp, top = teacher_targets(teacher[0, :-1, :vocab], top_k=top_k)
    logp, top = logp[None], None if top is None else top[None]
    on_policy, on_policy_grad = _rl_loss(student, ids, logp, top, top_k=top_k, vocab=vocab)
    offline, offline_grad = _distill_loss(student, ids, logp, top, vocab=vocab)
    assert float(on_policy) > 0.1
    assert float(on_policy) == pytest.approx(float(offline), abs=1e-6)
    assert torch.allclose(on_policy_grad, offline_grad, atol=1e-7)
    assert float(on_policy_grad[..., vocab:].abs().max()) == 0.0  # padding rows get no gradient


def test_top_k_v_minus_1_is_the_full_divergence_on_the_tiny_models_widths(tiny) -> None:
    ids, student, teacher, vocab = tiny
    losses = {}
    for top_k in (None, vocab - 1):
        logp, top = teacher_targets(teacher[0, :-1, :vocab], top_k=top_k)
        logp, top = logp[None], None if top is None else top[None]
        losses[top_k] = _rl_loss(student, ids, logp, top, top_k=top_k, vocab=vocab)
    full, full_grad = losses[None]
    grouped, grouped_grad = losses[vocab - 1]
    assert float(grouped) == pytest.approx(float(full), abs=1e-6)
    assert torch.allclose(grouped_grad, full_grad, atol=1e-7)
