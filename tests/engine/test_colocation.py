"""What colocated roles offload and the per-phase memory plan (roll_core/engine/colocation.py),
with hand-computed numbers; and the recipe errors around offload."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.config import load_recipe
from roll_core.engine.colocation import phase_peaks
from roll_core.engine.plan import make_plan
from roll_core.errors import ConfigError
from roll_core.pipelines import plan

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3
P = 8_190_735_360  # Qwen3-8B parameters (tests/engine/test_scale_recipes.py)
TWO_GPUS = [
    "executor.num_gpus=2",
    "actor_train.world_size=2",
    "actor_infer.world_size=2",
    "trainer.micro_batch_size=1",
]
V = 151_936  # Qwen3's vocabulary
# One Qwen3-8B micro-batch row of 1024 + 8192 positions, 8192 of them response, bf16
# (engine/placement.py): logits 2 x 9216 x V + 10 x 8192 x V (taking the response rows out,
# the largest step) and the layer inputs gradient checkpointing keeps, 36 x 9216 x 4096 x 2
LOGITS_8B = 2 * 9216 * V + 10 * 8192 * V  # 15,247,081,472 bytes = 14.2 GiB
LAYERS_8B = 36 * 9216 * 4096 * 2  # 2,717,908,992 bytes = 2.5 GiB
# ... with the output layer in chunks (the default, ZeRO-3 too): one chunk of 110 positions,
# 22 bytes a logit (bf16 logits, their float32 copy, the backward's): 367,685,120 = 0.34 GiB
CHUNK_8B = 22 * 110 * V
WHOLE = ["actor_train.logit_chunk_tokens=0"]


def test_phase_peaks_by_hand() -> None:
    train = {"params": 2.0, "grads": 2.0, "optimizer": 12.0}
    infer = {"params": 4.0, "kv_cache": 20.0}
    nothing = phase_peaks(train, infer, train_off=(), infer_weights=False, infer_kv=False)
    assert nothing == {"generate": 40.0, "train": 40.0, "sync": 40.0}  # all resident
    every = phase_peaks(
        train, infer, train_off=("optimizer", "grads", "params"), infer_weights=True, infer_kv=True
    )
    # generate: infer 4 + 20, training all away; train: 16, inference asleep;
    # sync: infer weights 4 + the params (the sync's source) 2, KV and the rest away
    assert every == {"generate": 24.0, "train": 16.0, "sync": 6.0}
    opt = phase_peaks(train, infer, train_off=("optimizer",), infer_weights=True, infer_kv=False)
    # generate 24 + params 2 + grads 2; train 16 + KV 20 kept; sync 4 + 2 + 2 + 20
    assert opt == {"generate": 28.0, "train": 36.0, "sync": 28.0}


def test_qwen3_8b_on_two_gpus_offloads_what_it_needs() -> None:
    # in chunks the same offload; train 8P + one chunk + the layer inputs = 63.9 GiB
    chunked = make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b.yaml", TWO_GPUS)).offload
    assert chunked.train == ("optimizer",) and chunked.infer_weights and chunked.infer_kv_cache
    assert chunked.peaks[0]["train"] == pytest.approx(8 * P + CHUNK_8B + LAYERS_8B)
    # the logits computed whole (below)
    cfg = load_recipe(ROOT / "recipes" / "qwen3-8b.yaml", [*TWO_GPUS, *WHOLE])
    choice = make_plan(cfg).offload
    # ZeRO-3 over 2 ranks, bf16: params P*2/2 = P, grads P, AdamW (8 + 4 master) P*12/2 = 6P
    # bytes; vLLM: weights 2P, KV the rest of 0.5 x 80 GiB. Resident 8P + 40 GiB = 101 GiB.
    # auto: inference asleep alone leaves generate at 40 GiB + 8P (over 80); + optimizer
    # offload: generate 40 GiB + 2P = 55.3 GiB, train 8P + one row's logits and layer inputs
    # = 61.0 + 14.2 + 2.5 = 77.8 GiB (two rows: 94.5, refused), sync 2P + P + P.
    assert choice.colocated and choice.train == ("optimizer",)
    assert choice.infer_weights and choice.infer_kv_cache
    assert choice.peaks[0] == pytest.approx(
        {"generate": 40 * GIB + 2 * P, "train": 8 * P + LOGITS_8B + LAYERS_8B, "sync": 4 * P}
    )
    rows = [r for r in plan(cfg) if r.role == "memory/phase"]
    assert [r.detail for r in rows] == [
        "generate 55.3 GiB, train 77.8 GiB, sync 30.5 GiB (of 80 GiB)"
    ]


def test_real_scale_recipes_fit_side_by_side_with_the_logits_in_chunks() -> None:
    # In chunks (the default; ZeRO-3 too) both fit with everything resident. Qwen3-8B on 8
    # GPUs: ZeRO-3 16P / 8 + one chunk 0.34 + 2 rows' layer inputs 5.1 + vLLM 40 = 60.7 GiB
    for recipe in ("qwen3-8b.yaml", "qwen3-30b-a3b-rlvr.yaml"):
        choice = make_plan(load_recipe(ROOT / "recipes" / recipe, [])).offload
        assert choice.colocated and not choice.active, recipe
    choice = make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b.yaml", [])).offload
    assert choice.peaks[0]["train"] == pytest.approx(2 * P + CHUNK_8B + 2 * LAYERS_8B + 40 * GIB)
    # Computed whole, the train phase is over 80 GiB unless vLLM sleeps while training:
    # 8B: 15.3 + 2 rows' logits 28.4 + layer inputs 5.1 + vLLM 40 = 88.7;
    # 30B-A3B: 28.4 + 14.2 + 1.7 + 36.0 = 80.3
    for recipe in ("qwen3-8b.yaml", "qwen3-30b-a3b-rlvr.yaml"):
        choice = make_plan(load_recipe(ROOT / "recipes" / recipe, WHOLE)).offload
        assert choice.colocated and choice.train == (), recipe
        assert choice.infer_weights and choice.infer_kv_cache, recipe
    disaggregated = make_plan(load_recipe(ROOT / "recipes" / "qwen2.5-7b-rlvr.yaml", [])).offload
    assert not disaggregated.colocated and not disaggregated.active


def test_a_plan_that_cannot_fit_is_refused(roll) -> None:
    recipe = ROOT / "tests" / "engine" / "recipes" / "qwen3-8b-one-gpu.yaml"
    with pytest.raises(ConfigError) as err:
        plan(load_recipe(recipe, []))
    # torch backend on 1 GPU: 16P bytes = 122.05 GiB, + one chunk of the output layer (110
    # positions x V x 22 bytes = 0.34 GiB; no gradient checkpointing, so no layer inputs
    # counted) in the train phase: 122.4 GiB
    assert "GPU 0 needs 122.4 GiB in the train phase, 42.4 GiB over" in str(err.value)
    res = roll("train", "rlvr", str(recipe), "--dry-run")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "the colocated plan does not fit" in res.stderr and "world_size" in res.stderr


def test_cpu_recipe_moves_only_what_is_asked() -> None:
    cfg = load_recipe(ROOT / "recipes" / "tiny-arith-rlvr.yaml", [])
    assert make_plan(cfg).offload.colocated and not make_plan(cfg).offload.active
    cfg = load_recipe(
        ROOT / "recipes" / "tiny-arith-rlvr.yaml",
        ["actor_train.offload.optimizer=true", "actor_infer.offload.weights=true"],
    )
    choice = make_plan(cfg).offload
    assert choice.train == ("optimizer",) and choice.infer_parts == ("weights",)


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        (
            "qwen2.5-7b-rlvr.yaml",
            ["actor_train.offload.optimizer=true"],
            r"do not share a device \(disaggregated\)",
        ),
        (
            "tiny-arith-rlvr.yaml",
            ["actor_infer.backend=vllm", "actor_infer.offload.weights=true"],
            "sleep mode is CUDA-only",
        ),
        (
            "qwen3-8b.yaml",
            ["actor_infer.offload.weights=true", "actor_infer.offload.kv_cache=false"],
            "sleep mode frees both at once",
        ),
    ],
)
def test_offload_recipe_errors(recipe: str, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(load_recipe(ROOT / "recipes" / recipe, overrides))


def test_offload_with_async_training_is_a_recipe_error() -> None:
    with pytest.raises(ConfigError, match="async_generation_ratio is 1"):
        load_recipe(
            ROOT / "recipes" / "tiny-arith-rlvr.yaml",
            ["rollout.async_generation_ratio=1", "actor_train.offload.params=true"],
        )
    # auto stays off with async; the colocated-GPU async check keeps refusing one device
    cfg = load_recipe(
        ROOT / "recipes" / "tiny-arith-rlvr.yaml", ["rollout.async_generation_ratio=1"]
    )
    assert not make_plan(cfg).offload.active
    with pytest.raises(ConfigError, match="time-share one device"):
        plan(load_recipe(ROOT / "recipes" / "qwen3-8b.yaml", ["rollout.async_generation_ratio=1"]))


def test_vllm_sleep_level_is_a_vllm_key() -> None:
    with pytest.raises(ConfigError, match="applies to the vllm backend"):
        load_recipe(
            ROOT / "recipes" / "tiny-arith-rlvr.yaml", ["actor_infer.offload.vllm_sleep_level=2"]
        )
    cfg = load_recipe(
        ROOT / "recipes" / "qwen3-8b.yaml", [*TWO_GPUS, "actor_infer.offload.vllm_sleep_level=2"]
    )
    assert make_plan(cfg).offload.sleep_level == 2
