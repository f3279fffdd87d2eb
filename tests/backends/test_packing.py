"""Packed and token-budget micro-batches (roll_core/backends/train/packing.py).

The plans are checked by hand; the packed forward against the padded one on the tiny Qwen3
text model and the tiny Qwen2.5-VL, fp32: log-probs, the loss of every objective (SFT, DPO,
RL with every loss-aggregation mode) and its gradients agree within 1e-5 whatever the
partition of the rows into micro-batches.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from roll_core.algorithms.aggregation import LOSS_AGG_MODES
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.packing import (
    PackedRows,
    check_packing_support,
    plan_micro_batches,
    row_lengths,
    trim_width,
)
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.config.schema import ActorTrainConfig, FSDP2Config, OptimConfig
from roll_core.data import Batch
from roll_core.errors import ConfigError
from roll_core.models import resolve_model_path
from roll_core.workers.objectives import get_objective

# ---- plans, by hand ---------------------------------------------------------------------------


def test_row_count_plan_is_consecutive_chunks() -> None:
    plan = plan_micro_batches([3, 1, 4, 1, 5], micro_batch_size=2, max_tokens=None, packed=True)
    assert plan == [[0, 1], [2, 3], [4]]


def test_token_budget_plan_first_fit_decreasing_packed() -> None:
    # lengths 5 2 7 1 4, budget 8 real tokens. Longest first: 7 (row 2) opens bin A; 5 (row 0)
    # opens B; 4 fits neither (7+4, 5+4 > 8): C; 2 fits B (5+2=7); 1 fits A (7+1=8).
    plan = plan_micro_batches([5, 2, 7, 1, 4], micro_batch_size=1, max_tokens=8, packed=True)
    assert plan == [[2, 3], [0, 1], [4]]


def test_token_budget_plan_padded_counts_rows_times_longest() -> None:
    # Same rows, padded cost rows x longest <= 8: 7 -> A; 5 -> B; 4 -> C (2x7, 2x5 > 8);
    # 2 -> C (2x4 = 8); 1 -> D (2x7, 2x5, 3x4 all > 8).
    plan = plan_micro_batches([5, 2, 7, 1, 4], micro_batch_size=1, max_tokens=8, packed=False)
    assert plan == [[2], [0], [1, 4], [3]]


def test_groups_stay_together_and_too_long_rows_are_recipe_errors() -> None:
    # DPO pairs (rows 2i, 2i+1): pair 0 costs 3+4 = 7, pair 1 costs 4: never split
    assert plan_micro_batches(
        [3, 4, 2, 2], micro_batch_size=1, max_tokens=7, packed=True, group=2
    ) == [[0, 1], [2, 3]]
    with pytest.raises(
        ConfigError,
        match=r"2 rows that must share a micro-batch \(a DPO pair: longest 4 tokens, 7 in all\)",
    ) as err:
        plan_micro_batches([3, 4, 2, 2], micro_batch_size=1, max_tokens=6, packed=True, group=2)
    assert "at least 7" in str(err.value.hint)
    with pytest.raises(ConfigError, match=r"max_tokens_per_micro_batch=4 .* row of this batch \(5"):
        plan_micro_batches([2, 5], micro_batch_size=1, max_tokens=4, packed=True)


def test_varlen_layout_is_one_sequence() -> None:
    attn = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    layout = PackedRows.from_mask(attn, varlen=True)
    assert layout.rows.tolist() == [0, 0, 0, 1, 1]
    assert layout.position_ids().tolist() == [[0, 1, 2, 0, 1]]  # restart at each row
    values = torch.arange(8.0).view(2, 4)
    packed = layout.pack(values)
    assert packed.tolist() == [[0.0, 1.0, 2.0, 4.0, 5.0]]
    assert layout.unpack(packed[..., None])[..., 0].tolist() == [[0, 1, 2, 0], [4, 5, 0, 0]]
    # logits from column 1 on: the packed positions kept, unpacked to [B, T - 1]
    assert layout.keep_indices(1).tolist() == [1, 2, 4]
    kept = packed[:, layout.keep_indices(1)]
    assert layout.unpack(kept[..., None], first_col=1)[..., 0].tolist() == [[1, 2, 0], [5, 0, 0]]


def test_dense_layout_packs_rows_into_bins_of_the_longest_row() -> None:
    # lengths 4, 1, 2, 3 in bins of 4 (first fit, longest first): row 0 alone; row 3 then
    # row 1; row 2 then 2 filler tokens (positions restarting at 0: a segment of their own)
    attn = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    layout = PackedRows.from_mask(attn)
    assert (layout.n_bins, layout.bin_width) == (3, 4)
    assert layout.position_ids().tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    values = torch.arange(16.0).view(4, 4)
    packed = layout.pack(values)
    assert packed.tolist() == [[0, 1, 2, 3], [12, 13, 14, 4], [8, 9, 0, 0]]
    assert layout.unpack(packed[..., None])[..., 0].tolist() == [
        [0, 1, 2, 3],
        [4, 0, 0, 0],
        [8, 9, 0, 0],
        [12, 13, 14, 0],
    ]
    # columns >= 1 sit in packed columns 1, 2, 3 of some bin: the logits kept for all bins
    assert layout.keep_indices(1).tolist() == [1, 2, 3]
    kept = packed[:, layout.keep_indices(1)]
    assert layout.unpack(kept[..., None], first_col=1)[..., 0].tolist() == [
        [1, 2, 3],
        [0, 0, 0],
        [9, 0, 0],
        [13, 14, 0],
    ]


def test_dense_layout_takes_one_sequence_when_its_mask_is_smaller() -> None:
    # lengths 4 and 1: two bins of 4 cost 2 x 4^2 = 32 mask cells, one sequence of 5 costs 25
    layout = PackedRows.from_mask(torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]))
    assert (layout.n_bins, layout.bin_width) == (1, 5)
    assert layout.position_ids().tolist() == [[0, 1, 2, 3, 0]]


def test_ordered_layout_keeps_the_token_order_for_images() -> None:
    # next fit in row order (a VLM's image features are placed in token order): row 0 alone,
    # rows 1 and 2 share a bin, row 3 starts a new one since 3 + 3 > 4
    attn = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    layout = PackedRows.from_mask(attn, ordered=True)
    assert layout.position_ids().tolist() == [[0, 1, 2, 3], [0, 0, 1, 0], [0, 1, 2, 0]]
    packed = layout.pack(torch.arange(16.0).view(4, 4))
    assert packed.tolist() == [[0, 1, 2, 3], [4, 8, 9, 0], [12, 13, 14, 0]]


def test_split_to_count_halves_the_heaviest_part_by_tokens() -> None:
    from roll_core.backends.train.packing import split_to_count

    lengths = [4, 1, 1, 2, 3, 1]
    attn = torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])
    batch = Batch(tensors={"input_ids": attn * 7, "attention_mask": attn})
    parts = [([0, 1, 2, 3], batch.select([0, 1, 2, 3])), ([4, 5], batch.select([4, 5]))]
    # 8 tokens vs 4: the first part splits where its running sum (4, 5, 6) is closest to 4:
    # after row 0; then [1, 2, 3] (4 tokens) ties with [4, 5] (4): the earlier one splits at
    # 1 + 1 = 2 of 4: [1, 2] | [3]
    out = split_to_count(parts, 4)
    assert [rows for rows, _ in out] == [[0], [1, 2], [3], [4, 5]]
    assert [mb.tensors["attention_mask"].sum().item() for _, mb in out] == [4, 2, 2, 4]
    # DPO pairs (group 2) stay together; single units cannot split further
    out = split_to_count(parts, 5, group=2)
    assert [rows for rows, _ in out] == [[0, 1], [2, 3], [4, 5]]


def test_ranks_in_lock_step_split_then_run_dummies() -> None:
    """sharded.py: a rank brings its micro-batches to the largest count of any rank (here 4):
    its 2-row part splits, then its single rows cannot, so one dummy (a copy of its last
    micro-batch, flagged) makes up the count."""
    from types import SimpleNamespace

    from roll_core.backends.train.sharded import ShardedTrainBackend

    attn = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    batch = Batch(tensors={"input_ids": attn, "attention_mask": attn})
    rank = SimpleNamespace(
        micro_batches=lambda b, objective=None: [([0, 1], b.select([0, 1])), ([2], b.select([2]))],
        _max_over_ranks=lambda n: 4,
    )
    out = ShardedTrainBackend.aligned_chunks(rank, batch)  # type: ignore[arg-type]
    assert [(rows, dummy) for rows, _, dummy in out] == [
        ([0], False),
        ([1], False),
        ([2], False),
        ([2], True),
    ]


def test_trim_cuts_input_and_target_columns_only() -> None:
    mb = Batch(
        tensors={
            "input_ids": torch.ones(2, 5, dtype=torch.long),
            "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]),
            "response_mask": torch.ones(2, 4),
            "teacher_logprobs": torch.ones(2, 4, 3),
            "scores": torch.ones(2),
        },
        meta={"x": 1},
    )
    out = trim_width(mb, 3)
    shapes = {k: tuple(v.shape) for k, v in out.tensors.items()}
    assert shapes == {
        "input_ids": (2, 3),
        "attention_mask": (2, 3),
        "response_mask": (2, 2),
        "teacher_logprobs": (2, 2, 3),
        "scores": (2,),
    }
    assert out.meta == {"x": 1}


def test_left_padding_is_refused() -> None:
    mb = Batch(tensors={"input_ids": torch.ones(1, 3), "attention_mask": torch.tensor([[0, 1, 1]])})
    with pytest.raises(ValueError, match="right-padded"):
        row_lengths(mb)


def test_bad_settings_are_recipe_errors() -> None:
    with pytest.raises(ValidationError, match="max_tokens_per_micro_batch"):
        ActorTrainConfig(max_tokens_per_micro_batch=0)
    with pytest.raises(ConfigError, match="must be positive, got -3"):
        TrainBackendSpec(model_path="m", max_tokens_per_micro_batch=-3)
    with pytest.raises(ConfigError, match="fsdp2 options are given to the torch"):
        TrainBackendSpec(model_path="m", fsdp2=FSDP2Config())
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="paged_attention"))
    with pytest.raises(ConfigError, match="'paged_attention' cannot confine") as err:
        check_packing_support(model)
    assert "packing: false" in str(err.value.hint)
    check_packing_support(SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa")))


def test_spec_is_one_picklable_value() -> None:
    spec = TrainBackendSpec(
        model_path="m", optim=OptimConfig(lr=3e-4), max_tokens_per_micro_batch=64
    )
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(AttributeError):
        spec.packing = False  # type: ignore[misc]


# ---- packed == padded on real models ---------------------------------------------------------


def text_backend() -> TorchTrainBackend:
    return TorchTrainBackend(
        TrainBackendSpec(
            model_path=resolve_model_path("builtin:tiny-qwen3"),
            device="cpu",
            precision="fp32",
            optim=OptimConfig(lr=1e-2, max_grad_norm=None),
            total_steps=10,
            micro_batch_size=2,
            num_threads=1,
        )
    )


@pytest.fixture(scope="module")
def text() -> TorchTrainBackend:
    return text_backend()


LENGTHS = [13, 5, 9, 2, 11, 7]


def rl_batch(mode: str) -> Batch:
    """6 right-padded rows (lengths 13 5 9 2 11 7), prompts of 3 tokens (row 3: 2 tokens, no
    response: it must not count as a sequence), the global counts in meta."""
    g = torch.Generator().manual_seed(1)
    b, width = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(3, 250, (b, width), generator=g)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(b, width - 1)
    for i, n in enumerate(LENGTHS):
        attn[i, :n] = 1
        resp[i, 2 : n - 1] = 1.0  # targets of tokens 3..n-1
    batch = Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
            "response_mask": resp,
            "advantages": torch.randn(b, width - 1, generator=g) * resp,
            "behaviour_log_probs": -torch.rand(b, width - 1, generator=g) * resp,
            "old_log_probs": -torch.rand(b, width - 1, generator=g) * resp,
            "ref_log_probs": -torch.rand(b, width - 1, generator=g) * resp,
            "loss_mask": torch.cat([torch.zeros(b, 1), resp], 1).long(),
        },
        meta={
            "response_tokens": float(resp.sum()),
            "sequences": float((resp.sum(1) > 0).sum()),
            "max_response_length": 16,
            "loss_tokens": float(resp.sum()),
        },
    )
    return batch


def grads_of(backend: TorchTrainBackend, batch: Batch, objective: Any) -> tuple[dict, dict]:
    """(metrics, gradients) of one train_step whose optimizer step is skipped."""
    step, sched = backend.optimizer.step, backend.scheduler.step
    backend.optimizer.step = lambda *a, **k: None  # type: ignore[method-assign]
    backend.scheduler.step = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        metrics = backend.train_step(batch, objective)
    finally:
        backend.optimizer.step, backend.scheduler.step = step, sched  # type: ignore[method-assign]
    grads = {
        n: p.grad.detach().clone()
        for n, p in backend.model.named_parameters()
        if p.grad is not None  # frozen (LoRA's base)
    }
    return metrics, grads


SETTINGS = [(False, None), (True, None), (True, 16), (True, 40), (False, 30)]
"""(packing, token budget): padded rows (the reference), packed rows, packed budgets of 16
and 40 tokens (one long row alone / rows grouped), a padded budget."""


def assert_same(
    backend: TorchTrainBackend, batch: Batch, objective: Any, settings: list = SETTINGS
) -> None:
    results = []
    for packing, budget in settings:
        backend.packing, backend.max_tokens = packing, budget
        results.append(grads_of(backend, batch, objective))
    (ref_metrics, ref_grads), *others = results
    for (packing, budget), (metrics, grads) in zip(settings[1:], others, strict=True):
        for key, value in ref_metrics.items():
            if key.startswith("perf/"):
                continue
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (packing, budget, key)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    backend.packing, backend.max_tokens = True, None


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_rl_loss_and_gradients_packed_equal_padded(text: TorchTrainBackend, mode: str) -> None:
    algo = AlgorithmConfig(
        loss_agg_mode=mode, kl={"coef": 0.1, "use_as": "loss"}, entropy_coef=0.01
    )
    assert_same(text, rl_batch(mode), get_objective("rl", algorithm=algo, temperature=0.9))


def test_sft_and_dpo_packed_equal_padded(text: TorchTrainBackend) -> None:
    batch = rl_batch("token-mean")
    assert_same(text, batch, get_objective("sft"))
    pairs = Batch(
        tensors={
            **{k: batch.tensors[k] for k in ("input_ids", "attention_mask", "loss_mask")},
            "pair_side": torch.tensor([0, 1, 0, 1, 0, 1]),
            "ref_logps": torch.tensor([-3.0, -4.0, -1.0, -2.0, -5.0, -2.5]),
        },
        meta={"pairs": 3},
    )
    # a pair never splits: budgets of at least its 13 + 5 tokens (padded: 2 x 13)
    settings = [(False, None), (True, None), (True, 18), (True, 40), (False, 30)]
    assert_same(text, pairs, get_objective("dpo", beta=0.5, sft_weight=0.3), settings)


def test_log_probs_packed_equal_padded_and_zero_on_padding(text: TorchTrainBackend) -> None:
    batch = rl_batch("token-mean")
    text.packing, text.max_tokens = False, None
    padded = text.log_probs(batch)
    text.packing, text.max_tokens = True, 20
    packed = text.log_probs(batch)
    text.max_tokens = None
    valid = batch.tensors["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    assert bool((packed[~valid] == 0).all()) and bool((padded[~valid] == 0).all())


def test_vision_language_packed_equals_padded(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tiny Qwen2.5-VL: rows with 0, 1 and 2 images packed together; the images' rope
    positions per row are those of the padded forward."""
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
        message = [image_message("count" + "!" * (3 * i), len(imgs))]
        ids, vision = encode_chat_images(proc, message, imgs, add_generation_prompt=True)
        rows.append(ids + [100 + i] * (2 + i))
        visions.append(vision if imgs else None)
    width = max(len(r) for r in rows)
    ids = torch.full((3, width), proc.tokenizer.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    batch = Batch(
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
            micro_batch_size=3,
            num_threads=1,
        )
    )
    assert backend._rope is not None  # the 3-D rope of Qwen2.5-VL is computed per row
    backend.packing = False
    padded = backend.log_probs(batch)
    backend.packing = True
    torch.testing.assert_close(backend.log_probs(batch), padded, rtol=0, atol=1e-5)
    longest = int(attn.sum(1).max())
    settings = [
        (False, None),
        (True, None),
        (True, longest + 2),
        (True, 4 * longest),
        (False, 2 * longest),
    ]
    assert_same(backend, batch, get_objective("sft"), settings)

    # with the processor's token types the model computes true 3-D (t, h, w) rope positions
    # for the image tokens; packed rows get each row's own, so the logits still agree
    from roll_core.backends.train.packing import model_forward
    from roll_core.data.vision import vision_model_inputs

    image_pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    vision = vision_model_inputs(batch) | {"mm_token_type_ids": (ids == image_pad).int()}
    assert backend._image_token == image_pad  # the trainer builds the same token types
    built = vision_model_inputs(batch, image_token_id=backend._image_token)
    assert torch.equal(built["mm_token_type_ids"], vision["mm_token_type_ids"])
    model = backend.model.eval()
    with torch.no_grad():
        padded_logits = model_forward(model, batch, backend.device, packing=False, vision=vision)
        packed_logits = model_forward(
            model, batch, backend.device, packing=True, rope=backend._rope, vision=vision
        )
        # what the model computes without token types: 1-D positions for the image tokens
        plain = model(
            input_ids=ids, attention_mask=attn, use_cache=False, **vision_model_inputs(batch)
        )
    valid = attn.bool()
    assert (padded_logits.logits - plain.logits)[valid].abs().max() > 1e-4  # rope 3-D mattered
    torch.testing.assert_close(
        packed_logits.logits[valid], padded_logits.logits[valid], rtol=0, atol=1e-5
    )


@pytest.mark.parametrize(
    ("recipe", "counted"),
    [
        ("tiny-arith-sft.yaml", "data.max_length"),
        ("tiny-dpo.yaml", "2 x data.max_length"),
        ("tiny-arith-rlvr.yaml", "data.max_prompt_length + rollout.max_new_tokens"),
    ],
)
def test_a_budget_below_the_recipes_longest_row_is_a_validate_error(
    recipe: str, counted: str
) -> None:
    from pathlib import Path

    from roll_core.config.loader import load_recipe
    from roll_core.config.schema import longest_train_row

    path = Path(__file__).parents[2] / "recipes" / recipe
    cfg = load_recipe(path)
    assert cfg.actor_train.packing is True  # the default
    longest, how = longest_train_row(cfg)
    assert counted in how
    with pytest.raises(ConfigError, match=f"smaller than the longest .* at least {longest}"):
        load_recipe(path, [f"actor_train.max_tokens_per_micro_batch={longest - 1}"])
    ok = load_recipe(path, [f"actor_train.max_tokens_per_micro_batch={longest}"])
    assert ok.actor_train.max_tokens_per_micro_batch == longest


def test_reference_teacher_and_critic_packed_equal_padded() -> None:
    """The workers with their own forward (the frozen reference and teacher, the critic's
    value model) give the padded path's numbers packed and with a token budget."""
    from roll_core.workers.critic import Critic
    from roll_core.workers.reference import Reference
    from roll_core.workers.teacher import Teacher

    path = resolve_model_path("builtin:tiny-qwen3")
    batch = rl_batch("token-mean")
    batch.tensors["values"] = torch.zeros_like(batch.tensors["response_mask"])
    batch.tensors["returns"] = (
        torch.linspace(-1, 1, 12).expand(6, 12) * batch.tensors["response_mask"]
    )
    valid = batch.tensors["attention_mask"][:, 1:].bool()
    kw = {"temperature": 1.0, "top_k": 3, "vocab_size": 200}
    results: dict[str, list] = {"reference": [], "teacher": [], "values": [], "critic": []}
    for packing, budget in [(False, None), (True, None), (True, 16)]:
        common = {"micro_batch_size": 2, "packing": packing, "max_tokens_per_micro_batch": budget}
        ref = Reference(
            model_path=path, device="cpu", num_threads=1, rank=0, world_size=1, **common
        )
        ref.setup()
        results["reference"].append(ref.log_probs(batch)[valid])
        spec = TrainBackendSpec(model_path=path, device="cpu", num_threads=1, **common)
        teacher = Teacher(spec=spec, rank=0, world_size=1)
        teacher.setup()
        results["teacher"].append(teacher.targets(batch, **kw))
        torch.manual_seed(0)
        critic = Critic(
            model_path=path,
            # eps 1: AdamW's first update is lr g / (|g| + 1), as close as the gradients
            optim=OptimConfig(lr=0.5, eps=1.0, max_grad_norm=None, scheduler="constant"),
            total_steps=2,
            device="cpu",
            precision="fp32",
            num_threads=1,
            rank=0,
            world_size=1,
            **common,
        )
        critic.setup()
        critic.train_step(batch)  # the head leaves zero: the next values are not all zero
        results["values"].append(
            critic.values(batch)[batch.tensors["attention_mask"][:, :-1].bool()]
        )
        results["critic"].append(critic.train_step(batch)["critic/value_loss"])
    for key in ("reference", "values"):
        for other in results[key][1:]:
            torch.testing.assert_close(other, results[key][0], rtol=0, atol=1e-5)
    assert results["values"][0].abs().max() > 1e-3
    for other in results["teacher"][1:]:
        assert other.keys() == results["teacher"][0].keys()
        torch.testing.assert_close(
            other["teacher_logprobs"], results["teacher"][0]["teacher_logprobs"], rtol=0, atol=1e-5
        )
        assert torch.equal(other["teacher_ids"], results["teacher"][0]["teacher_ids"])
    assert results["critic"][1:] == pytest.approx([results["critic"][0]] * 2, rel=1e-5)
