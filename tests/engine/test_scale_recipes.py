"""The real-scale recipes validate offline: `--dry-run` prints the placement per node and the
memory per GPU for 8 and 16 GPUs, and impossible plans are refused with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.config import load_recipe
from roll_core.engine.resource_plan import gpu_plan
from roll_core.errors import ConfigError
from roll_core.pipelines import plan

ROOT = Path(__file__).resolve().parents[2]
SIXTEEN = ["executor.num_gpus=16", "actor_train.world_size=16", "actor_infer.world_size=16"]


@pytest.mark.parametrize(
    ("recipe", "overrides", "gpus", "nodes", "colocated"),
    [
        ("qwen3-8b.yaml", [], 8, 1, True),
        ("qwen3-8b.yaml", SIXTEEN, 16, 2, True),
        ("qwen2.5-7b-rlvr.yaml", [], 8, 1, False),
        ("qwen3-30b-a3b-rlvr.yaml", [], 16, 2, True),
    ],
)
def test_scale_recipes_plan_offline(recipe, overrides, gpus, nodes, colocated) -> None:
    cfg = load_recipe(ROOT / "recipes" / recipe, overrides)
    gp = gpu_plan(cfg)
    assert gp is not None
    assert gp.placement.num_gpus == gpus and gp.placement.num_nodes == nodes
    assert bool(gp.placement.colocated()) == colocated
    for mem in gp.memory:  # every GPU is used and the estimate fits an 80 GiB GPU
        assert mem.roles and mem.peak_taking_turns < 80 * 1024**3
    assert any(r.role == "memory/GPU" for r in plan(cfg))


def test_qwen3_8b_memory_numbers() -> None:
    # ZeRO-3 over 8 ranks, bf16 params: 8.19e9 x (2 params + 2 grads + 12 optimizer) / 8
    cfg = load_recipe(ROOT / "recipes" / "qwen3-8b.yaml", [])
    train = gpu_plan(cfg).memory[0].roles["actor_train"]
    assert train["params"] == pytest.approx(8_190_735_360 * 2 / 8)
    assert train["optimizer"] == pytest.approx(8_190_735_360 * 12 / 8)
    # vLLM at gpu_memory_utilization 0.5 of 80 GiB: 40 GiB for weights + KV cache
    infer = gpu_plan(cfg).memory[0].roles["actor_infer"]
    assert infer["params"] + infer["kv_cache"] == pytest.approx(40 * 1024**3)


def test_impossible_plan_is_refused_by_the_cli(roll) -> None:
    res = roll(
        "train",
        "rlvr",
        str(ROOT / "recipes" / "qwen3-8b.yaml"),
        "actor_train.world_size=16",
        "--dry-run",
        env={"COLUMNS": "200"},
    )
    assert res.returncode != 0
    assert "uses GPU 15 but the cluster has 8 GPUs" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    ok = roll("train", "rlvr", str(ROOT / "recipes" / "qwen3-8b.yaml"), *SIXTEEN, "--dry-run")
    assert ok.returncode == 0, ok.stderr
    assert "actor_train ranks 8-15 on GPUs 8-15" in ok.stdout
    # the roles share GPUs; with ZeRO-3's logits in chunks both fit side by side
    assert "colocated, nothing offloaded" in ok.stdout


def test_bad_backend_options_are_config_errors() -> None:
    path = ROOT / "recipes" / "qwen3-8b.yaml"
    with pytest.raises(ConfigError, match="offload_param needs zero_stage 3"):
        load_recipe(
            path,
            ["actor_train.deepspeed.zero_stage=2", "actor_train.deepspeed.offload_param=true"],
        )
    with pytest.raises(ConfigError, match="backend to fsdp2 or deepspeed"):
        load_recipe(path, ["actor_train.backend=torch", "actor_train.deepspeed=null"])
    with pytest.raises(ConfigError, match="deepspeed options are set but actor_train.backend"):
        load_recipe(path, ["actor_train.backend=fsdp2"])


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_plans(recipe: str) -> None:
    # every pipeline's config (sft, dpo, distill, rlvr, agentic) goes through the GPU plan
    plan(load_recipe(ROOT / "recipes" / recipe, []))
