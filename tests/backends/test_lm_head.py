"""The LM head a chunk of positions at a time (roll_core/backends/train/lm_head.py, issue 44).

Chunked (``logit_chunk_tokens`` > 0: the forward stops at the hidden states, each chunk's
logits recomputed in the backward) against unchunked (0: the model's own full logits), fp32
on CPU: values, metrics and gradients (hidden states, the head's weight and bias, every
parameter of the tiny model, whose head is tied to its embedding) agree within 1e-6 for every
pass that reads per-token log-probs: the policy update (entropy bonus, KL, on-policy
distillation's `mode: full` with and without top-k), SFT, DPO, distillation, the old /
reference log-probs, the reference's and the teacher's distributions; packed and padded,
with token budgets, with LoRA (the head itself adapted too). Then what the chunking is for:
the largest tensor and the peak of live CPU memory of a large-vocabulary update.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from roll_core.algorithms.distill import teacher_targets
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.lm_head import (
    HeadInput,
    chunked_map,
    deferral_blocker,
    head_input_of,
)
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.config.schema import LoraConfig, OptimConfig
from roll_core.data import Batch
from roll_core.models import resolve_model_path
from roll_core.workers.objectives import get_objective

TOL = {"rtol": 1e-6, "atol": 1e-6}


def _log_prob_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return [logp.gather(-1, targets[:, None]).squeeze(-1), entropy]


def test_log_prob_and_entropy_by_hand() -> None:
    """Two positions, vocabulary 2, hidden 1, head weight [[0], [ln 3]]: at hidden 1 the
    logits are (0, ln 3), p = (1/4, 3/4); at hidden 0 they are (0, 0), p = (1/2, 1/2)."""
    head = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [math.log(3.0)]]))
    hidden = torch.tensor([[1.0], [0.0]])
    targets = torch.tensor([1, 0])
    logp, entropy = chunked_map(_log_prob_and_entropy, hidden, [targets], head=head, chunk_tokens=1)
    # log p(1) = log 3/4; log p(0) = log 1/2
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75), math.log(0.5)]))
    # H = -(1/4 log 1/4 + 3/4 log 3/4) = 0.5623351; H = log 2
    torch.testing.assert_close(entropy, torch.tensor([0.5623351, math.log(2.0)]))
    # d log p(1) / d w1 at hidden 1 = (1 - 3/4) x 1; the row at hidden 0 adds nothing
    logp.sum().backward()
    torch.testing.assert_close(head.weight.grad, torch.tensor([[-0.25], [0.25]]))


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunks_equal_one_pass_values_and_gradients(chunk: int) -> None:
    """Log-probs, entropies and the gradients w.r.t. the hidden states, the head's weight and
    bias: one chunk of 1, 3 (not dividing N = 20), 7 or 64 (> N) positions at a time."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(20, 16, requires_grad=True)
    targets = torch.randint(0, 50, (20,))
    weights = torch.randn(2, 20)  # a loss that reads both outputs at every position

    def grads(chunk_tokens: int, use_head: bool) -> list[torch.Tensor]:
        hidden.grad = head.weight.grad = head.bias.grad = None
        rows = hidden if use_head else head(hidden)  # use_head False: logits given, one pass
        logp, ent = chunked_map(
            _log_prob_and_entropy,
            rows,
            [targets],
            head=head if use_head else None,
            chunk_tokens=chunk_tokens,
        )
        ((weights[0] * logp).sum() + (weights[1] * ent).sum()).backward()
        return [logp.detach(), ent.detach(), hidden.grad, head.weight.grad, head.bias.grad]

    one_pass = grads(0, use_head=False)
    for got, want in zip(grads(chunk, use_head=True), one_pass, strict=True):
        torch.testing.assert_close(got, want, **TOL)


# ---- the tiny model: every objective, chunked == unchunked ------------------------------------


def tiny_backend(lora: LoraConfig | None = None) -> TorchTrainBackend:
    return TorchTrainBackend(
        TrainBackendSpec(
            model_path=resolve_model_path("builtin:tiny-qwen3"),
            device="cpu",
            precision="fp32",
            optim=OptimConfig(lr=1e-2, max_grad_norm=None),
            micro_batch_size=2,
            num_threads=1,
            lora=lora,
        )
    )


@pytest.fixture(scope="module")
def tiny() -> TorchTrainBackend:
    return tiny_backend()


LENGTHS = [13, 5, 9, 2, 11, 7]
VOCAB = 259  # the tiny tokenizer's; the model's head has 320 rows


def batch() -> Batch:
    """6 right-padded rows (lengths 13 5 9 2 11 7), prompts of 3 tokens (row 3: no
    response), every field the objectives read, the global counts in meta; teacher targets
    (random distributions, full vocabulary and top-5) for distill and `mode: full`."""
    g = torch.Generator().manual_seed(1)
    b, width = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(3, 250, (b, width), generator=g)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(b, width - 1)
    for i, n in enumerate(LENGTHS):
        attn[i, :n] = 1
        resp[i, 2 : n - 1] = 1.0
    teacher = torch.randn(b, width - 1, VOCAB, generator=g) * 3
    full, _ = teacher_targets(teacher)
    top, top_ids = teacher_targets(teacher, top_k=5)
    assert top_ids is not None
    return Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
            "response_mask": resp,
            "advantages": torch.randn(b, width - 1, generator=g) * resp,
            "behaviour_log_probs": -torch.rand(b, width - 1, generator=g) * resp,
            "old_log_probs": -torch.rand(b, width - 1, generator=g) * resp,
            "ref_log_probs": -torch.rand(b, width - 1, generator=g) * resp,
            "loss_mask": torch.cat([torch.zeros(b, 1), resp], 1).long(),
            "pair_side": torch.tensor([0, 1, 0, 1, 0, 1]),
            "ref_logps": torch.tensor([-3.0, -4.0, -1.0, -2.0, -5.0, -2.5]),
            "full": full,
            "top": top,
            "top_ids": top_ids,
        },
        meta={
            "response_tokens": float(resp.sum()),
            "sequences": float((resp.sum(1) > 0).sum()),
            "max_response_length": 16,
            "loss_tokens": float(resp.sum()),
            "pairs": 3,
        },
    )


def with_teacher(b: Batch, prefix: str, top_k: int | None) -> Batch:
    """``b`` with the teacher's targets under the names objective ``prefix`` reads."""
    t = dict(b.tensors)
    logp, ids = (t["top"], t["top_ids"]) if top_k else (t["full"], None)
    if prefix == "teacher_dist_":  # the rl objective, `mode: full`
        t["teacher_dist_logprobs"] = logp
        if ids is not None:
            t["teacher_dist_ids"] = ids
    else:  # roll distill
        t["teacher_logprobs"] = logp
        t["teacher_top1"] = ids[..., 0] if ids is not None else logp.argmax(-1)
        if ids is not None:
            t["teacher_ids"] = ids
    return Batch(tensors=t, meta=dict(b.meta))


def full_distill(top_k: int | None) -> AlgorithmConfig:
    return AlgorithmConfig.model_validate(
        {
            "preset": "grpo",
            "entropy_coef": 0.01,
            "on_policy_distill": {"teacher": {"path": "t"}, "mode": "full", "top_k": top_k},
        }
    )


CASES: dict[str, tuple[Any, Any]] = {
    "rl": (
        lambda: get_objective(
            "rl",
            algorithm=AlgorithmConfig(kl={"coef": 0.1, "use_as": "loss"}, entropy_coef=0.01),
            temperature=0.9,
        ),
        batch,
    ),
    "rl-entropy-metric-only": (
        lambda: get_objective("rl", algorithm=AlgorithmConfig(), temperature=0.7),
        batch,
    ),
    "rl-full-distill": (
        lambda: get_objective("rl", algorithm=full_distill(None), vocab_size=VOCAB),
        lambda: with_teacher(batch(), "teacher_dist_", None),
    ),
    "rl-full-distill-top-k": (
        lambda: get_objective("rl", algorithm=full_distill(5), vocab_size=VOCAB),
        lambda: with_teacher(batch(), "teacher_dist_", 5),
    ),
    "sft": (lambda: get_objective("sft"), batch),
    "dpo": (lambda: get_objective("dpo", beta=0.5, sft_weight=0.3), batch),
    "distill": (
        lambda: get_objective("distill", loss_type="jsd", vocab_size=VOCAB, temperature=2.0),
        lambda: with_teacher(batch(), "teacher_", None),
    ),
    "distill-top-k": (
        lambda: get_objective("distill", loss_type="reverse_kl", vocab_size=VOCAB),
        lambda: with_teacher(batch(), "teacher_", 5),
    ),
}


def step_of(backend: TorchTrainBackend, b: Batch, objective: Any) -> tuple[dict, dict]:
    """(metrics, gradients of every trainable parameter) of one train_step, its optimizer
    step skipped."""
    step, sched = backend.optimizer.step, backend.scheduler.step
    backend.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
    backend.scheduler.step = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        metrics = backend.train_step(b, objective)
    finally:
        backend.optimizer.step, backend.scheduler.step = step, sched  # type: ignore[method-assign]
    grads = {
        n: p.grad.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad
    }
    return metrics, grads


def assert_chunks_change_nothing(
    backend: TorchTrainBackend, b: Batch, objective: Any, settings: list[tuple[int, bool, Any]]
) -> None:
    """Every (chunk, packing, budget) in ``settings`` gives the metrics and gradients of the
    first (which must be unchunked) at the same packing; gradients are not all zero."""
    results = {}
    for chunk, packing, budget in settings:
        backend.logit_chunk_tokens, backend.packing, backend.max_tokens = chunk, packing, budget
        results[chunk, packing, budget] = step_of(backend, b, objective)
    backend.logit_chunk_tokens, backend.packing, backend.max_tokens = 512, True, None
    for (chunk, packing, budget), (metrics, grads) in results.items():
        ref_metrics, ref_grads = results[0, packing, None]
        for key, value in ref_metrics.items():
            if not key.startswith("perf/"):
                assert metrics[key] == pytest.approx(value, **{"rel": 1e-6, "abs": 1e-6}), key
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, **TOL, msg=f"{name} {chunk} {budget}")
    assert any(float(g.abs().max()) > 0 for g in grads.values())


SETTINGS = [(0, True, None), (3, True, None), (512, True, None), (4, True, 18)]
SETTINGS += [(0, False, None), (5, False, None)]
"""(logit_chunk_tokens, packing, token budget): unchunked first, then chunks of 3 (many,
not dividing the positions), 512 (one chunk), 4 with a budget; the padded path."""


@pytest.mark.parametrize("case", CASES)
def test_objectives_chunked_equal_unchunked(tiny: TorchTrainBackend, case: str) -> None:
    make_objective, make_batch = CASES[case]
    assert tiny.head_blocker is None and tiny.model.config.tie_word_embeddings
    assert_chunks_change_nothing(tiny, make_batch(), make_objective(), SETTINGS)


def test_tied_head_gradient_is_the_sum_of_both_uses(tiny: TorchTrainBackend) -> None:
    """The embedding and the head are one tensor: its gradient (compared above) carries the
    head's chunks and the embedding lookups; without the head's part it would differ."""
    model = tiny.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tiny.logit_chunk_tokens = 3
    _, grads = step_of(tiny, batch(), get_objective("sft"))
    tiny.logit_chunk_tokens = 512
    emb = grads["model.embed_tokens.weight"]
    used = set(batch().tensors["input_ids"][batch().tensors["attention_mask"].bool()].tolist())
    unused_rows = [i for i in range(emb.shape[0]) if i not in used]
    # rows of tokens never in the input get gradient only through the head (softmax mass)
    assert float(emb[unused_rows].abs().max()) > 0


@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj"], ["q_proj", "v_proj", "lm_head"]], ids=["attn", "head"]
)
def test_lora_chunked_equals_unchunked(targets: list[str]) -> None:
    """LoRA (peft): the adapters' gradients; with ``lm_head`` among the targets the head is
    peft's wrapper, called as a module per chunk (base + adapter)."""
    backend = tiny_backend(LoraConfig(rank=4, alpha=8, target_modules=targets))
    with torch.no_grad():  # B starts at 0: move it so every adapter has a gradient
        for name, p in backend.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    head = backend.model.get_output_embeddings()
    assert ("lora" in type(head).__module__) == ("lm_head" in targets)
    settings = [(0, True, None), (3, True, None), (4, True, 18)]
    algo = AlgorithmConfig(kl={"coef": 0.1, "use_as": "loss"}, entropy_coef=0.01)
    assert_chunks_change_nothing(backend, batch(), get_objective("rl", algorithm=algo), settings)
    assert_chunks_change_nothing(backend, batch(), get_objective("sft"), settings)


# ---- the log-prob passes --------------------------------------------------------------------


def test_log_prob_passes_chunked_equal_unchunked(tiny: TorchTrainBackend) -> None:
    """Old / reference log-probs (backend and Reference), the reference's `mode: full`
    distributions and the teacher's targets, with and without top-k."""
    from roll_core.workers.reference import Reference
    from roll_core.workers.teacher import Teacher

    b = batch()
    path = resolve_model_path("builtin:tiny-qwen3")
    got: dict[int, list[torch.Tensor]] = {}
    for chunk in (0, 3):
        tiny.logit_chunk_tokens = chunk
        ref = Reference(model_path=path, device="cpu", packing=True, logit_chunk_tokens=chunk)
        ref.setup()
        teacher = Teacher(
            spec=TrainBackendSpec(model_path=path, device="cpu", logit_chunk_tokens=chunk)
        )
        teacher.setup()
        dist = {k: ref.distributions(b, temperature=0.8, top_k=k, vocab_size=VOCAB) for k in (None, 5)}  # fmt: skip
        targets = {k: teacher.targets(b, temperature=2.0, top_k=k, vocab_size=VOCAB) for k in (None, 5)}  # fmt: skip
        got[chunk] = [
            tiny.log_probs(b, temperature=0.7),
            ref.log_probs(b, temperature=0.7),
            *[v for d in (*dist.values(), *targets.values()) for v in d.values()],
        ]
    tiny.logit_chunk_tokens = 512
    assert len(got[3]) == 2 + 3 + 5
    for chunked, one_pass in zip(got[3], got[0], strict=True):
        if one_pass.dtype.is_floating_point:
            torch.testing.assert_close(chunked, one_pass, **TOL)
        else:
            assert torch.equal(chunked, one_pass)
    assert float(got[3][0].abs().sum()) > 0


def test_models_whose_logits_are_not_the_heads_output_are_not_deferred() -> None:
    """A logit soft-cap (Gemma 2) transforms the head's output inside the forward: the
    frozen form falls back to the model's own logits (chunked for the float32 work only)."""
    model = tiny_backend().model
    assert deferral_blocker(model) is None
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping=30.0" in str(deferral_blocker(model))
    ids = torch.tensor([[5, 6, 7]])
    inp = head_input_of(model, lambda: model(input_ids=ids), chunk_tokens=2)
    assert inp.head is None and inp.values.shape == (1, 3, 320)  # the logits


# ---- memory: what the chunking is for -------------------------------------------------------


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the bytes of the largest tensor any aten op returns (forward and backward:
    on CPU the backward runs on this thread, under this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _update(chunk: int, hidden: torch.Tensor, head: torch.nn.Linear, ids: torch.Tensor) -> None:
    """One RL-style update's head part on hidden states ``[1, N, H]``: log-probs and the
    entropy bonus at every position, backward into hidden and head."""
    inp = HeadInput(hidden, head, chunk) if chunk else HeadInput(head(hidden), None, 0)
    select = torch.ones(hidden.shape[:2], dtype=torch.bool)
    logp, ent = inp.map(_log_prob_and_entropy, select, ids)
    (logp.sum() + 0.01 * ent.sum()).backward()


def test_chunked_update_never_holds_a_tokens_by_vocabulary_tensor() -> None:
    """N = 512 positions, V = 32,768: one [N, V] float32 tensor is 64 MiB. The unchunked
    head builds several; chunks of 64 never build one above 64 x V x 4 = 8 MiB, forward or
    backward (the head's [V, H] weight gradient, 4 MiB, is the largest other tensor)."""
    torch.manual_seed(0)
    n, hidden_size, vocab, chunk = 512, 32, 32768, 64
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, n, hidden_size, requires_grad=True)
    ids = torch.randint(0, vocab, (n,))
    largest = {}
    for c in (0, chunk):
        with LargestTensor() as mode:
            _update(c, hidden, head, ids)
        largest[c] = mode.largest
    assert largest[0] >= n * vocab * 4  # the full float32 logits (and their log-softmax)
    assert largest[chunk] == chunk * vocab * 4  # one chunk's


def _peak_live_bytes(fn: Any) -> int:
    """Peak of the CPU allocator's live bytes while ``fn()`` runs, from the memory events of
    torch's profiler (allocations positive, frees negative, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        if e.name() == "[memory]"
    ]
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


def test_chunked_update_peak_memory_is_a_fraction_of_unchunked() -> None:
    """Peak live CPU memory of the same update (N = 512, V = 32,768; forward and backward),
    measured by torch's profiler: unchunked it holds several [N, V] float32 tensors (64 MiB
    each) at once; in chunks of 64 the peak is under a quarter of that."""
    torch.manual_seed(0)
    n, hidden_size, vocab = 512, 32, 32768
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, n, hidden_size, requires_grad=True)
    ids = torch.randint(0, vocab, (n,))
    full = _peak_live_bytes(lambda: _update(0, hidden, head, ids))
    chunked = _peak_live_bytes(lambda: _update(64, hidden, head, ids))
    one = n * vocab * 4
    assert full >= 2 * one  # logits, log-softmax, softmax... kept for the backward
    assert chunked < full / 4, (chunked, full)


def test_vision_language_model_chunked_equals_unchunked() -> None:
    """Tiny Qwen2.5-VL (its head on the top-level model, tied to the language model's
    embedding): rows with 1, 0 and 2 images, packed; SFT gradients and log-probs."""
    from PIL import Image

    from roll_core.data.chat import encode_chat_images, image_message
    from roll_core.data.vision import vision_fields
    from roll_core.models.vision import load_processor

    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    proc = load_processor(path)
    images = [
        [Image.new("RGB", (56, 56), (255, 0, 0))],
        [],
        [Image.new("RGB", (84, 56), (0, 0, 255)), Image.new("RGB", (56, 56), (0, 255, 0))],
    ]
    rows, visions = [], []
    for i, imgs in enumerate(images):
        ids, vision = encode_chat_images(
            proc, [image_message("count" + "!" * i, len(imgs))], imgs, add_generation_prompt=True
        )
        rows.append(ids + [100 + i] * (2 + i))
        visions.append(vision if imgs else None)
    width = max(len(r) for r in rows)
    ids = torch.full((3, width), proc.tokenizer.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    b = Batch(
        tensors={"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone()},
        non_tensors=vision_fields(visions),
        meta={"loss_tokens": float(attn[:, 1:].sum())},
    )
    backend = TorchTrainBackend(
        TrainBackendSpec(
            model_path=path,
            device="cpu",
            precision="fp32",
            optim=OptimConfig(max_grad_norm=None),
            micro_batch_size=2,
            num_threads=1,
        )
    )
    assert backend.head_blocker is None
    settings = [(0, True, None), (5, True, None), (0, False, None), (7, False, None)]
    assert_chunks_change_nothing(backend, b, get_objective("sft"), settings)
    backend.logit_chunk_tokens = 0
    one_pass = backend.log_probs(b)
    backend.logit_chunk_tokens = 5
    torch.testing.assert_close(backend.log_probs(b), one_pass, **TOL)


def test_the_recipe_key_reaches_every_role_and_is_validated(monkeypatch) -> None:
    """`actor_train.logit_chunk_tokens`: the schema's default is lm_head.py's; it reaches the
    backend spec, and the reference and teacher of the recipes; negative values are errors."""
    from pathlib import Path

    from pydantic import ValidationError

    from roll_core.backends.train.base import spec_from_config
    from roll_core.backends.train.lm_head import DEFAULT_CHUNK_TOKENS
    from roll_core.config import load_recipe
    from roll_core.config.schema import ActorTrainConfig
    from roll_core.errors import ConfigError

    assert ActorTrainConfig().logit_chunk_tokens == DEFAULT_CHUNK_TOKENS
    recipe = Path(__file__).parents[2] / "recipes" / "tiny-arith-rlvr.yaml"
    cfg = load_recipe(recipe, ["actor_train.logit_chunk_tokens=7"])
    spec = spec_from_config(cfg, model_path="m", total_steps=1, micro_batch_size=1)
    assert spec.logit_chunk_tokens == 7
    import roll_core.pipelines.roles as roles

    built: dict[str, dict] = {}

    def record(name: str, *args: Any, worker_kwargs: dict, **kwargs: Any) -> None:
        built[name] = worker_kwargs

    monkeypatch.setattr(roles, "Cluster", record)
    roles.build_reference(cfg, None, model_path="m", micro_batch_size=1)
    distill = load_recipe(
        recipe.with_name("tiny-distill.yaml"), ["actor_train.logit_chunk_tokens=9"]
    )
    roles.build_teacher(distill, None, model_path="m", tokenizer_path="t")
    assert built["reference"]["logit_chunk_tokens"] == 7
    assert built["teacher"]["spec"].logit_chunk_tokens == 9
    with pytest.raises((ConfigError, ValidationError), match="logit_chunk_tokens"):
        load_recipe(recipe, ["actor_train.logit_chunk_tokens=-1"])
    with pytest.raises(ConfigError, match="logit_chunk_tokens must be 0 or more"):
        TrainBackendSpec(model_path="m", logit_chunk_tokens=-1)
