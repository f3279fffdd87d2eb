"""The chunked output layer (roll_core/backends/train/lm_head.py).

By hand: a one-dimensional hidden state and a two-token vocabulary. Against the unchunked
computation, fp32, within 1e-6: log-probs, entropies and gradients of every objective (SFT,
DPO, offline distillation, RL with KL, an entropy bonus and full-distribution on-policy
distillation), packed and padded, with LoRA, on the tiny Qwen3 (tied embeddings), and the
teacher's and reference's passes. And what the chunking is for: no tensor of [positions x
vocabulary] is saved for the backward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.lm_head import (
    LMHead,
    deferrable_head,
    distribution_targets,
    target_log_probs,
)
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.config.schema import LoraConfig, OptimConfig
from roll_core.data import Batch
from roll_core.models import resolve_model_path
from roll_core.workers.objectives import get_objective
from tests.backends.test_packing import grads_of as packing_grads_of
from tests.backends.test_packing import rl_batch as packing_rl_batch


def test_log_prob_by_hand() -> None:
    # hidden h = 2, weight rows w0 = 1, w1 = -0.5: logits (2, -1); log p(token 1) at T = 1 is
    # -1 - log(e^2 + e^-1) = -3.048587...; at T = 2 the logits are (1, -0.5): -1.701413
    layer = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0], [-0.5]]))
    head = LMHead(torch.tensor([[[2.0], [0.0]]]), layer, vocab_size=2, chunk_tokens=1)
    ids = torch.tensor([[0, 1]])
    mask = torch.tensor([[True]])
    torch.set_grad_enabled(False)
    assert float(target_log_probs(head, ids, mask)[0, 0]) == pytest.approx(
        -1 - math.log(math.exp(2) + math.exp(-1)), abs=1e-6
    )
    assert float(target_log_probs(head, ids, mask, temperature=2.0)[0, 0]) == pytest.approx(
        -0.5 - math.log(math.exp(1) + math.exp(-0.5)), abs=1e-6
    )
    torch.set_grad_enabled(True)


def _terms(logits: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    z = logits.float() / 0.7
    logp = torch.log_softmax(z, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return [logp.gather(-1, targets[:, None]).squeeze(-1), entropy, z.max(-1).values]


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_map_equals_the_whole_computation_and_its_gradients(chunk: int) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 11)
    hidden = torch.randn(3, 6, 5, requires_grad=True)
    mask = torch.rand(3, 5) > 0.3
    targets = torch.randint(0, 11, (int(mask.sum()),))
    weights = torch.randn(3, int(mask.sum()))

    def run(head: LMHead) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        hidden.grad, layer.weight.grad, layer.bias.grad = None, None, None
        values = head.map(mask, _terms, targets)
        loss = sum((w * v).sum() for w, v in zip(weights, values, strict=True))
        loss.backward()
        grads = [hidden.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]
        return [v.detach() for v in values], grads

    whole = run(LMHead.from_logits(layer(hidden)))
    chunked = run(LMHead(hidden, layer, vocab_size=11, chunk_tokens=chunk))
    for a, b in zip(whole[0] + whole[1], chunked[0] + chunked[1], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


@pytest.mark.parametrize("positions", [0, 4, 9])
def test_a_collective_head_calls_the_layer_as_often_as_the_busiest_rank(
    monkeypatch: pytest.MonkeyPatch, positions: int
) -> None:
    """A collective head (ZeRO-3: the layer is gathered at each call) makes as many calls as
    the rank with the most chunks, here 4 (monkeypatched agreement), forward and backward,
    whatever this rank holds: 0, 4 (2 chunks of 3, 2 empty ones) or 9 positions (3 + 1 empty);
    values and gradients those of the whole computation."""
    import roll_core.backends.train.lm_head as lm_head

    monkeypatch.setattr(lm_head, "_max_over_ranks", lambda count, device: max(count, 4))
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 11)
    calls: list[int] = []
    layer.register_forward_hook(lambda mod, args, out: calls.append(int(args[0].shape[0])))
    hidden = torch.randn(1, 10, 5, requires_grad=True)
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, :positions] = True
    targets = torch.randint(0, 11, (positions,))

    def run(head: LMHead) -> list[torch.Tensor]:
        hidden.grad, layer.weight.grad = None, None
        (values,) = head.map(
            mask, lambda lg, t: (lg.log_softmax(-1).gather(-1, t[:, None]),), targets
        )
        (values.sum() + hidden.sum() * 0).backward()
        return [values.detach(), hidden.grad.clone(), layer.weight.grad.clone()]

    whole = run(LMHead.from_logits(layer(hidden)))
    calls.clear()
    chunked = run(LMHead(hidden, layer, vocab_size=11, chunk_tokens=3, collective=True))
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    # 4 calls in the forward, 4 recomputed in the backward, the empty ones included
    sizes = [min(3, max(0, positions - 3 * k)) for k in range(4)]
    assert sorted(calls) == sorted(sizes * 2)


def test_no_positions_x_vocabulary_tensor_is_saved_for_the_backward() -> None:
    """The autograd graph of a chunked pass holds nothing of [positions x vocabulary] (the
    chunk's logits are recomputed in the backward); the unchunked one holds them."""
    torch.manual_seed(0)
    vocab, positions = 1000, 64
    layer = torch.nn.Linear(8, vocab)
    hidden = torch.randn(1, positions, 8, requires_grad=True)
    mask = torch.ones(1, positions, dtype=torch.bool)
    targets = torch.randint(0, vocab, (positions,))

    def largest_saved(head: LMHead) -> int:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            values = head.map(mask, _terms, targets)
        sum(v.sum() for v in values).backward()
        return max(sizes)

    assert largest_saved(LMHead(hidden, layer, vocab_size=vocab, chunk_tokens=0)) >= (
        positions * vocab
    )
    # the layer's weight (vocab x 8) is the largest thing kept; 8 x vocab < positions x vocab
    assert largest_saved(LMHead(hidden, layer, vocab_size=vocab, chunk_tokens=8)) <= 8 * vocab


def test_auto_chunk_and_models_whose_head_cannot_be_deferred() -> None:
    layer = torch.nn.Linear(4, 151_936)
    auto = LMHead(torch.zeros(1, 2, 4), layer, vocab_size=151_936)
    assert auto.chunk_tokens == 2**24 // 151_936 == 110
    small = LMHead(torch.zeros(1, 2, 4), layer, vocab_size=320)
    assert small.chunk_tokens == 2**24 // 320

    class Model(torch.nn.Module):
        def __init__(self, **config: Any) -> None:
            super().__init__()
            self.config = type("C", (), config)()
            self.lm_head = torch.nn.Linear(2, 3)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

    assert deferrable_head(Model()) is not None
    assert deferrable_head(Model(final_logit_softcapping=None)) is not None
    assert deferrable_head(Model(final_logit_softcapping=30.0)) is None  # Gemma 2
    assert deferrable_head(Model(logit_scale=0.0625)) is None  # Cohere
    assert deferrable_head(Model(logits_scaling=1.0)) is not None  # Granite, scale 1


# ---- objectives on the tiny Qwen3 (tied embeddings) -------------------------------------------


def backend(*, lora: bool = False) -> TorchTrainBackend:
    spec = TrainBackendSpec(
        model_path=resolve_model_path("builtin:tiny-qwen3"),
        device="cpu",
        precision="fp32",
        optim=OptimConfig(lr=1e-2, max_grad_norm=None),
        total_steps=10,
        micro_batch_size=2,
        num_threads=1,
        lora=LoraConfig(rank=4, alpha=8) if lora else None,
    )
    return TorchTrainBackend(spec)


@pytest.fixture(scope="module")
def tiny() -> TorchTrainBackend:
    return backend()


def rl_batch(vocab: int) -> Batch:
    """test_packing's 6 right-padded rows (prompts of 3 tokens, row 3 without a response),
    with the teacher's full distributions for (on-policy) distillation and DPO pairs."""
    batch = packing_rl_batch("token-mean")
    g = torch.Generator().manual_seed(2)
    rows, width = batch.tensors["response_mask"].shape
    teacher = torch.log_softmax(3 * torch.randn(rows, width, vocab, generator=g), -1)
    batch.tensors |= {
        "teacher_dist_logprobs": teacher,
        "teacher_logprobs": teacher,
        "teacher_top1": teacher.argmax(-1),
        "pair_side": torch.tensor([0, 1, 0, 1, 0, 1]),
        "ref_logps": torch.tensor([-3.0, -4.0, -1.0, -2.0, -5.0, -2.5]),
    }
    batch.meta["pairs"] = 3
    return batch


def grads_of(model: TorchTrainBackend, batch: Batch, objective: Any, chunk: int) -> tuple:
    """(metrics, gradients) of one train_step (optimizer step skipped) at `chunk`."""
    model.spec = dataclasses.replace(model.spec, logit_chunk_tokens=chunk)
    return packing_grads_of(model, batch, objective)


def assert_chunked_equal(model: TorchTrainBackend, batch: Batch, objective: Any) -> None:
    for packing in (True, False):
        model.packing = packing
        whole_metrics, whole = grads_of(model, batch, objective, 0)
        metrics, grads = grads_of(model, batch, objective, 4)
        assert grads.keys() == whole.keys() and grads
        for key, value in whole_metrics.items():
            if not key.startswith("perf/"):
                assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
        for name, g in whole.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=name)
    model.packing = True


def opd_algorithm() -> AlgorithmConfig:
    return AlgorithmConfig.model_validate(
        {
            "kl": {"coef": 0.1, "use_as": "loss"},
            "entropy_coef": 0.01,
            "on_policy_distill": {"teacher": {"path": "t"}, "mode": "full"},
        }
    )


def test_every_objective_chunked_equals_whole(tiny: TorchTrainBackend) -> None:
    vocab = len(tiny.tokenizer)
    width = int(tiny.model.config.vocab_size)
    batch = rl_batch(vocab)
    assert_chunked_equal(
        tiny,
        batch,
        get_objective("rl", algorithm=opd_algorithm(), temperature=0.9, vocab_size=vocab),
    )
    plain = AlgorithmConfig(kl={"coef": 0.0})  # the entropy metric without a graph
    no_teacher = Batch(
        tensors={k: v for k, v in batch.tensors.items() if k != "teacher_dist_logprobs"},
        meta=batch.meta,
    )
    assert_chunked_equal(tiny, no_teacher, get_objective("rl", algorithm=plain))
    assert_chunked_equal(tiny, batch, get_objective("sft"))
    assert_chunked_equal(tiny, batch, get_objective("dpo", beta=0.5, sft_weight=0.3))
    batch.tensors["teacher_logprobs"] = torch.log_softmax(
        torch.randn(*batch.tensors["input_ids"][:, 1:].shape, vocab), -1
    )
    assert width >= vocab
    assert_chunked_equal(tiny, batch, get_objective("distill", vocab_size=vocab))


def test_lora_chunked_equals_whole() -> None:
    model = backend(lora=True)
    batch = rl_batch(len(model.tokenizer))
    del batch.tensors["teacher_dist_logprobs"]
    assert_chunked_equal(model, batch, get_objective("rl", algorithm=AlgorithmConfig()))


def test_log_prob_and_teacher_passes_chunked_equal_whole(tiny: TorchTrainBackend) -> None:
    batch = rl_batch(len(tiny.tokenizer))
    tiny.spec = dataclasses.replace(tiny.spec, logit_chunk_tokens=0)
    whole = tiny.log_probs(batch, temperature=0.8)
    head, _ = tiny.head(batch)
    mask = batch.tensors["response_mask"].bool()
    full = distribution_targets(head, mask, temperature=0.8, top_k=5, vocab_size=300)
    tiny.spec = dataclasses.replace(tiny.spec, logit_chunk_tokens=3)
    torch.testing.assert_close(tiny.log_probs(batch, temperature=0.8), whole, rtol=0, atol=1e-6)
    head, _ = tiny.head(batch)
    assert head.project is not None and head.chunk_tokens == 3
    chunked = distribution_targets(head, mask, temperature=0.8, top_k=5, vocab_size=300)
    torch.testing.assert_close(chunked[0], full[0], rtol=0, atol=1e-6)
    assert chunked[1] is not None and torch.equal(chunked[1], full[1])
    assert (whole[batch.tensors["attention_mask"][:, 1:] == 0] == 0).all()


def test_token_stats_entropy_by_the_definition(tiny: TorchTrainBackend) -> None:
    """The rollout record's per-token entropy: -sum p log p of softmax(logits / T), from the
    full logits, equal with and without chunks; log-probs as log_probs gives them."""
    batch = rl_batch(len(tiny.tokenizer))
    tiny.spec = dataclasses.replace(tiny.spec, logit_chunk_tokens=0)
    with torch.no_grad():
        logits = tiny.forward(batch)[:, :-1].float() / 0.7
    logp_all = torch.log_softmax(logits, -1)
    want = -(logp_all.exp() * logp_all).sum(-1)
    valid = batch.tensors["attention_mask"][:, 1:].bool()
    for chunk in (0, 3):
        tiny.spec = dataclasses.replace(tiny.spec, logit_chunk_tokens=chunk)
        stats = tiny.token_stats(batch, temperature=0.7)
        torch.testing.assert_close(stats["entropy"][valid], want[valid], rtol=0, atol=1e-5)
        assert (stats["entropy"][~valid] == 0).all()
        torch.testing.assert_close(
            stats["log_probs"], tiny.log_probs(batch, temperature=0.7), rtol=0, atol=1e-6
        )
