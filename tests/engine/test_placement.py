"""Placement of roles on GPUs, the memory estimate and the recipe dry-run (pure, no GPU)."""

from __future__ import annotations

import pytest

from roll_core.engine.model_sizes import KNOWN_CONFIGS, ModelShape, model_shape
from roll_core.engine.placement import (
    GIB,
    RoleRequest,
    TrainMemorySpec,
    gpu_memory,
    infer_memory,
    place,
    span,
    train_memory,
)
from roll_core.errors import ConfigError


def test_colocated_and_disaggregated_roles() -> None:
    p = place(
        [
            RoleRequest("actor_train", world_size=8),
            RoleRequest("actor_infer", world_size=4, gpus_per_worker=2),
        ]
    )
    assert p.num_gpus == 8 and p.num_nodes == 1
    assert p.roles["actor_infer"].ranks[1] == (2, 3)  # TP 2: rank r on GPUs 2r, 2r+1
    assert p.colocated() == [("actor_train", "actor_infer")]
    split = place(
        [
            RoleRequest("actor_train", world_size=8, device_mapping=tuple(range(8))),
            RoleRequest("actor_infer", world_size=8, device_mapping=tuple(range(8, 16))),
        ],
        num_gpus=16,
    )
    assert split.colocated() == [] and split.num_nodes == 2
    assert split.node_lines() == [
        "node 0 (GPUs 0-7): actor_train ranks 0-7 on GPUs 0-7",
        "node 1 (GPUs 8-15): actor_infer ranks 0-7 on GPUs 8-15",
    ]


@pytest.mark.parametrize(
    ("requests", "num_gpus", "message"),
    [
        (
            [RoleRequest("actor_train", 4, 1, (0, 1, 2, 9))],
            8,
            "device_mapping uses GPU 9 but the cluster has 8",
        ),
        (
            [RoleRequest("actor_train", 8)],
            4,
            r"8 GPUs from GPU 0\) uses GPU 7 but the cluster has 4",
        ),
        ([RoleRequest("actor_infer", 1, 2, (0, 1, 2))], None, "does not divide"),
        ([RoleRequest("actor_train", 4, 1, (0, 1))], None, "needs world_size 4 x"),
        ([RoleRequest("actor_train", 1, 1, (0, 1))], None, "uses 1 of the 2 GPUs"),
        ([RoleRequest("actor_infer", 1, 2, (7, 8))], 16, "rank 0 spans nodes"),
        ([RoleRequest("actor_infer", 1, 16)], 16, "more than a node has"),
    ],
)
def test_impossible_plans_are_rejected(requests, num_gpus, message) -> None:
    with pytest.raises(ConfigError, match=message):
        place(requests, num_gpus=num_gpus, gpus_per_node=8)


def test_span() -> None:
    assert span([3, 0, 1, 2, 6, 8, 9]) == "0-3,6,8-9"


def test_model_shapes_match_published_sizes() -> None:
    # Qwen3-8B: 8.19B; Qwen2.5-7B: 7.62B; Qwen3-30B-A3B: 30.5B total, 3.3B active
    assert model_shape("Qwen/Qwen3-8B").params == 8_190_735_360
    assert round(model_shape("Qwen/Qwen2.5-7B-Instruct").params / 1e9, 2) == 7.62
    moe = model_shape("Qwen/Qwen3-30B-A3B-Base")
    assert round(moe.params / 1e9, 1) == 30.5 and round(moe.active_params / 1e9, 1) == 3.4
    # the built-in tiny model: the count the torch backend reports
    assert model_shape("builtin:tiny-qwen3").params == 434_944
    assert model_shape("someone/unknown-model") is None
    assert "Qwen/Qwen3-8B" in KNOWN_CONFIGS


def test_vision_language_shapes_count_the_vision_tower() -> None:
    # published sizes: Qwen2.5-VL-3B 3.75B, Qwen2.5-VL-7B 8.29B, each with a ~0.67B vision
    # tower (32 blocks of hidden 1280, patch merger into the LM's hidden size)
    small, large = (
        model_shape("Qwen/Qwen2.5-VL-3B-Instruct"),
        model_shape("Qwen/Qwen2.5-VL-7B-Instruct"),
    )
    assert round(small.params / 1e9, 2) == 3.75 and round(large.params / 1e9, 2) == 8.29
    # the merger's last layer maps into the LM: 5120 x 2048 vs 5120 x 3584 weights
    assert large.vision_params - small.vision_params == 5120 * (3584 - 2048) + (3584 - 2048)
    assert round(small.vision_params / 1e9, 2) == 0.67
    lm_only = ModelShape.from_config(
        {
            k: v
            for k, v in KNOWN_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"].items()
            if k != "vision_config"
        }
    )
    assert large.params - lm_only.params == large.vision_params


def test_memory_estimate_by_backend() -> None:
    # 1e9 params in bf16 over 8 ranks: params 2 GB, grads 2 GB, optimizer 12 B/param
    # (fp32 master + 2 moments) = 12 GB
    n = 1_000_000_000

    class Fixed(ModelShape):
        @property
        def params(self) -> int:
            return n

    s = Fixed(1, 1, 1, 1, 1, 1, 1, True)
    torch_ = train_memory(s, TrainMemorySpec("torch", 8, param_bytes=2))
    assert torch_ == {"params": 2e9, "grads": 2e9, "optimizer": 12e9}
    z2 = train_memory(s, TrainMemorySpec("deepspeed", 8, param_bytes=2, zero_stage=2))
    assert z2 == {"params": 2e9, "grads": 2e9 / 8, "optimizer": 12e9 / 8}
    z3 = train_memory(
        s, TrainMemorySpec("deepspeed", 8, param_bytes=2, zero_stage=3, offload_optimizer=True)
    )
    assert z3 == {"params": 2e9 / 8, "grads": 2e9 / 8, "optimizer": 0.0}
    fsdp = train_memory(s, TrainMemorySpec("fsdp2", 4, param_bytes=4))
    assert fsdp == {"params": 1e9, "grads": 1e9, "optimizer": 2e9}  # fp32: 8 B/param optim


def test_kv_cache_and_per_gpu_sum() -> None:
    shape = model_shape("Qwen/Qwen3-8B")
    # K and V x 36 layers x 8 kv heads x 128 dims x 2 bytes = 147456 bytes per token
    assert shape.kv_bytes_per_token(2) == 147_456
    inf = infer_memory(shape, tensor_parallel=2, dtype_bytes=2, kv_tokens=10_000)
    assert inf["kv_cache"] == 147_456 * 10_000 / 2
    assert inf["params"] == shape.params * 2 / 2
    p = place([RoleRequest("actor_train", 2), RoleRequest("actor_infer", 1, 2)])
    mem = gpu_memory(p, {"actor_train": {"params": 1 * GIB}, "actor_infer": {"kv": 3 * GIB}})
    assert mem[1].resident == 4 * GIB and mem[1].peak_taking_turns == 3 * GIB


def test_logits_memory_by_hand() -> None:
    """One micro-batch's logits (issue 32 item 7), b bytes per logit, C = 2**26 elements per
    float32 chunk, BLV logits of which NV response; whole (`logit_chunk_tokens: 0`): the
    largest of the log-prob pass (BLV b + 8 min(C, BLV)), taking the response rows out (BLV b
    + NV (b + 4 + 4 [b = 2])), the entropy metric (BLV b + 8 NV + 8 min(C, NV)) and backward
    (12 NV)."""
    from roll_core.engine.placement import LOGIT_CHUNK, LogitsSpec, logits_memory

    v10 = ModelShape(1, 1, 1, 1, 1, 1, vocab_size=10, tie_embeddings=True)
    # B 2 x L 5 x V 10 = 100 logits, 60 of them response (R 3); all under one chunk.
    # bf16: log-prob 200 + 800 = 1000, rows 200 + 600 = 800, entropy 200 + 480 + 480 = 1160,
    # backward 720: 1160
    assert logits_memory(v10, LogitsSpec(2, 5, 3, logits_bytes=2, chunk_tokens=0)) == 1160.0
    # fp32: 400 + 800 = 1200, 400 + 480 = 880, 400 + 480 + 480 = 1360, 720: 1360
    assert logits_memory(v10, LogitsSpec(2, 5, 3, logits_bytes=4, chunk_tokens=0)) == 1360.0
    # a long prompt and a 1-token response: the log-prob pass is the largest:
    # 2*1000 + 8*1000 = 10000 (rows 2000 + 100, entropy 2000 + 80 + 80, backward 120)
    assert logits_memory(v10, LogitsSpec(1, 100, 1, logits_bytes=2, chunk_tokens=0)) == 10000.0
    # a token budget of 20 positions: BL = NV/V = 20 whatever the rows (all may be response):
    # 200 logits; bf16: log-prob 400 + 1600, rows 400 + 200 x 10 = 2400, entropy 400 + 1600 +
    # 1600 = 3600, backward 2400: 3600
    spec = LogitsSpec(2, 5, 3, logits_bytes=2, max_tokens=20, chunk_tokens=0)
    assert logits_memory(v10, spec) == 3600.0
    # Qwen3's vocabulary, one row of 1024 + 8192 positions (recipes/qwen3-30b-a3b-rlvr.yaml):
    # BLV = 9216 x 151936 = 1,400,242,176 and NV = 8192 x 151936 = 1,244,659,712 are both over
    # one chunk; taking the rows out is the largest: 2 BLV + 10 NV = 2,800,484,352 +
    # 12,446,597,120 = 15,247,081,472 bytes (14.2 GiB); entropy 2 BLV + 8 NV + 8 C =
    # 13,294,632,960, backward 14,935,916,544, log-prob pass 2 BLV + 8 C = 3,337,355,264
    qwen3 = model_shape("Qwen/Qwen3-30B-A3B")
    assert LOGIT_CHUNK == 2**26
    assert logits_memory(qwen3, LogitsSpec(1, 9216, 8192, chunk_tokens=0)) == 15_247_081_472.0


def test_chunked_logits_memory_by_hand() -> None:
    """Chunked (backends/train/lm_head.py): E = c V logits at a time, c = logit_chunk_tokens
    (null: 2**24 // V); the log-prob pass E (b + w + 8), the loss pass E (b + w + 16), w = 4
    when b = 2 (the float32 copy); c is at most the pass's positions. A micro-batch of at
    most c positions computes its logits whole."""
    from roll_core.engine.placement import LogitsSpec, logits_memory

    v10 = ModelShape(1, 1, 1, 1, 1, 1, vocab_size=10, tie_embeddings=True)
    # null: c = 1,677,721 >= the 10 positions: whole, as in test_logits_memory_by_hand
    assert logits_memory(v10, LogitsSpec(2, 5, 3, logits_bytes=2)) == 1160.0
    assert logits_memory(v10, LogitsSpec(2, 5, 3, logits_bytes=4)) == 1360.0
    # c = 2: log-prob 2 x 10 x 14 = 280, loss 20 x 22 = 440
    assert logits_memory(v10, LogitsSpec(2, 5, 3, logits_bytes=2, chunk_tokens=2)) == 440.0
    # Qwen3, one row of 9216 positions: c = 2**24 // 151936 = 110, E = 16,712,960, bf16:
    # loss 22 E = 367,685,120 bytes (0.34 GiB) against 15,247,081,472 whole; and a token
    # budget changes nothing
    qwen3 = model_shape("Qwen/Qwen3-30B-A3B")
    assert logits_memory(qwen3, LogitsSpec(1, 9216, 8192)) == 367_685_120.0
    assert logits_memory(qwen3, LogitsSpec(1, 9216, 8192, max_tokens=16384)) == 367_685_120.0


def test_logit_chunk_is_the_trainers() -> None:
    """engine/ cannot import backends/: the constant is written twice and must agree."""
    from roll_core.backends.train import lm_head
    from roll_core.engine import placement

    assert placement.LOGIT_CHUNK == lm_head.LOG_PROB_CHUNK
    assert placement.AUTO_CHUNK_ELEMENTS == lm_head.AUTO_CHUNK_ELEMENTS


def test_dry_run_counts_the_logits_and_says_what_moves() -> None:
    """recipes/qwen3-30b-a3b-rlvr.yaml on 16 GPUs with its logits computed whole
    (`logit_chunk_tokens: 0`): ZeRO-3 28.4 GiB + logits 14.2 + the layer inputs gradient
    checkpointing keeps 1.7 next to vLLM's 36.0 GiB is 80.3 GiB: over 80 unless vLLM leaves the
    GPU while training. In chunks (the default) the logits are 0.3 GiB and nothing moves."""
    from pathlib import Path

    from roll_core.config import load_recipe
    from roll_core.pipelines import plan

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-30b-a3b-rlvr.yaml"
    chunked = {r.role + "/" + r.worker: r.detail for r in plan(load_recipe(recipe, []))}
    assert "logits while training 0.3, " in chunked["memory/GPU/estimate"]
    assert chunked["colocation/Turns"].startswith("colocated, nothing offloaded")
    whole = load_recipe(recipe, ["actor_train.logit_chunk_tokens=0"])
    rows = {r.role + "/" + r.worker: r.detail for r in plan(whole)}
    assert rows["memory/GPU/estimate"] == (
        "actor_train 44.3 GiB (params 3.6, grads 3.6, optim 21.3, logits while training 14.2, "
        "checkpointed layer inputs 1.7) + actor_infer 36.0 GiB (params 28.4, kv 7.6); 80.3 GiB "
        "if both stay on the GPU, 44.3 GiB if each leaves it while the other works; fits 80 GiB "
        "only by moving memory between phases"
    )
    assert (
        "one micro-batch's logits and checkpointed layer inputs included"
        in (rows["memory/GPU/model"])
    )
    assert rows["colocation/Turns"].startswith(
        "colocated, taking turns: offload actor_infer weights+kv_cache"
    )
    assert rows["memory/phase/estimate"] == (
        "generate 64.4 GiB, train 44.3 GiB, sync 56.9 GiB (of 80 GiB)"
    )


def test_the_logits_term_follows_the_token_budget() -> None:
    """With actor_train.max_tokens_per_micro_batch a micro-batch holds up to that many
    positions whatever micro_batch_size says: 16,384 x 151,936 logits, all of them possibly
    response, bf16: taking the rows out 12 x 2,489,319,424 bytes = 27.8 GiB; the layer inputs
    48 x 16,384 x 2,048 x 2 = 3.0 GiB."""
    from pathlib import Path

    from roll_core.config import load_recipe
    from roll_core.pipelines import plan

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-30b-a3b-rlvr.yaml"
    budget = "actor_train.max_tokens_per_micro_batch=16384"
    cfg = load_recipe(recipe, [budget, "actor_train.logit_chunk_tokens=0"])
    rows = {r.role + "/" + r.worker: r.detail for r in plan(cfg)}
    assert (
        "logits while training 27.8, checkpointed layer inputs 3.0)"
        in (rows["memory/GPU/estimate"])
    )
    # in chunks (the default; DeepSpeed ZeRO-3, the recipe's, and FSDP2 alike): one chunk's
    # logits whatever the budget (the layer inputs still follow it)
    fsdp2 = ["actor_train.backend=fsdp2", "actor_train.deepspeed=null"]
    for overrides in ([budget], [budget, *fsdp2]):
        rows = {r.role + "/" + r.worker: r.detail for r in plan(load_recipe(recipe, overrides))}
        assert (
            "logits while training 0.3, checkpointed layer inputs 3.0)"
            in (rows["memory/GPU/estimate"])
        )
