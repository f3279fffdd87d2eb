"""Recipe errors of the `megatron` train backend, found before anything starts: the
`actor_train.megatron` section alone (schema) and against the model's config.json
(`check_recipe_layout`, what `roll validate` / `--dry-run` run). No processes, milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from roll_core.backends.train.megatron_model import check_recipe_layout
from roll_core.config.schema import ActorTrainConfig, MegatronConfig
from roll_core.errors import ConfigError
from roll_core.models import resolve_model_path


def role(world_size: int = 1, backend: str = "megatron", **megatron: object) -> ActorTrainConfig:
    return ActorTrainConfig.model_validate(
        {"backend": backend, "world_size": world_size, "megatron": megatron}
    )


def test_a_valid_layout() -> None:
    r = role(16, tp=2, pp=2, ep=2, sp=True, vpp=2)
    assert r.megatron == MegatronConfig(tp=2, pp=2, ep=2, sp=True, vpp=2)


@pytest.mark.parametrize(
    ("world", "layout", "message"),
    [
        (6, {"tp": 2, "pp": 2}, r"world_size=6 is not a multiple of megatron tp x pp x ep = "
         r"2 x 2 x 1 = 4"),
        (8, {"tp": 2, "pp": 2, "ep": 4}, r"not a multiple of .* = 16"),
        (2, {"sp": True}, r"sp needs tp > 1"),
        (4, {"tp": 2, "cp": 2}, r"cp=2: context parallelism needs Transformer Engine"),
        (2, {"vpp": 2}, r"vpp=2 needs pp > 1"),
    ],
)  # fmt: skip
def test_layout_errors_name_the_sizes(world: int, layout: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        role(world, **layout)


def test_megatron_options_need_the_megatron_backend() -> None:
    with pytest.raises(ValidationError, match="actor_train.megatron options are set but"):
        role(2, backend="fsdp2", tp=2)


def test_lora_is_a_recipe_error() -> None:
    """megatron-core has no LoRA here: refused at validate time, saying what to set instead."""
    with pytest.raises(ValidationError, match=r"lora is supported by the torch backend only "
                       r"\(backend is megatron.*remove actor_train.lora"):  # fmt: skip
        ActorTrainConfig.model_validate(
            {"backend": "megatron", "world_size": 2, "megatron": {"tp": 2}, "lora": {"rank": 4}}
        )


def dense() -> dict:
    """tiny-qwen3's config.json: Qwen3 dense, 2 layers, 4 heads, 2 key/value heads."""
    return json.loads((Path(resolve_model_path("builtin:tiny-qwen3")) / "config.json").read_text())


def moe(experts: int = 4, layers: int = 4) -> dict:
    """The same as Qwen3-MoE with `experts` experts and `layers` layers."""
    config = dense()
    config.update(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=experts,
        num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=layers,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    return config


@pytest.mark.parametrize(
    ("layout", "world", "message"),
    [
        ({"pp": 4}, 4, r"2 layers do not split into pp x vpp = 4"),  # tiny-qwen3: 2 layers
        ({"ep": 2}, 2, r"ep=2 needs a mixture-of-experts model; this one is dense"),
        ({"tp": 8}, 8, r"4 attention heads do not split over tp=8"),
    ],
)
def test_dense_model_errors(layout: dict, world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_recipe_layout(dense(), MegatronConfig(**layout), world)


def test_moe_model_errors() -> None:
    path = moe()
    with pytest.raises(ConfigError, match=r"4 experts do not split over ep=8"):
        check_recipe_layout(path, MegatronConfig(ep=8), 8)
    with pytest.raises(ConfigError, match=r"tp > 1 needs sp: true"):
        check_recipe_layout(path, MegatronConfig(tp=2), 2)
    check_recipe_layout(path, MegatronConfig(tp=2, sp=True, ep=2, pp=2, vpp=2), 8)  # fits


def test_dry_run_refuses_a_layout_the_model_cannot_take(roll, tiny_recipe) -> None:
    """`roll sft --dry-run` (no process started): pp=4 on tiny-qwen3's 2 layers."""
    recipe = tiny_recipe(
        actor_train={"backend": "megatron", "world_size": 4, "megatron": {"pp": 4}},
    )
    r = roll("sft", str(recipe), "--dry-run")
    assert r.returncode != 0
    assert "2 layers do not split into pp x vpp = 4 pipeline stages" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_scale_recipe_memory() -> None:
    """recipes/qwen3-30b-a3b-megatron-rlvr.yaml: tp 2 x pp 2 x ep 4 on 16 GPUs. Dense weights
    split 4 ways, experts 16 ways, AdamW state (12 bytes per bf16 parameter) 16 ways."""
    from roll_core.config import load_recipe
    from roll_core.engine.model_sizes import model_shape
    from roll_core.engine.resource_plan import gpu_plan

    root = Path(__file__).resolve().parents[2]
    cfg = load_recipe(root / "recipes" / "qwen3-30b-a3b-megatron-rlvr.yaml", [])
    shape = model_shape(cfg.model.path)
    experts = shape.num_layers * shape.num_experts * 3 * shape.hidden_size
    experts *= shape.moe_intermediate_size
    train = gpu_plan(cfg).memory[0].roles["actor_train"]
    assert train["params"] == pytest.approx(((shape.params - experts) / 4 + experts / 16) * 2)
    assert train["optimizer"] == pytest.approx(shape.params * 12 / 16)


def test_megatron_tp_does_not_change_the_inference_engines_plan() -> None:
    """The trainer's tensor parallelism (megatron.tp) and vLLM's (tensor_parallel_size 2 in
    the recipe) are separate: changing the first leaves actor_infer's memory as it is."""
    from roll_core.config import load_recipe
    from roll_core.engine.resource_plan import gpu_plan

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-30b-a3b-megatron-rlvr.yaml"
    layouts = [[], ["actor_train.megatron.tp=1", "actor_train.megatron.sp=false"]]
    infer = [gpu_plan(load_recipe(recipe, o)).memory[0].roles["actor_infer"] for o in layouts]
    assert infer[0]["params"] == infer[1]["params"] > 0


def test_kl_reference_is_sharded_as_the_policy() -> None:
    """KL on with a megatron actor_train: the reference is a frozen megatron model on
    actor_train's 16 ranks (not one unsharded 30B rank on GPU 0), and each GPU holds its share
    of the weights (the same bytes as the policy's params) for the whole run."""
    from roll_core.config import load_recipe
    from roll_core.engine.resource_plan import gpu_plan
    from roll_core.pipelines import plan as plan_rows

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-30b-a3b-megatron-rlvr.yaml"
    plain, kl = (load_recipe(recipe, o) for o in ([], ["algorithm.kl.coef=0.04"]))
    (row,) = [r for r in plan_rows(kl) if r.role == "reference"]
    assert (row.worker, row.backend, row.world_size) == ("Reference", "megatron", 16)
    assert "tp2 x pp2 x ep4" in row.detail
    assert not [r for r in plan_rows(plain) if r.role == "reference"]
    without, with_ref = (gpu_plan(c).memory[0].roles["actor_train"] for c in (plain, kl))
    assert "reference" not in without
    assert with_ref["reference"] == with_ref["params"] == without["params"] > 0


def test_only_megatron_builds_a_frozen_backend() -> None:
    """`TrainBackendSpec.frozen` (the sharded reference) is megatron's alone: the other
    backends' frozen roles load the plain model, so asking them for one is a caller's bug."""
    from roll_core.backends.train.base import TrainBackendSpec

    assert TrainBackendSpec(model_path="m", backend="megatron", frozen=True).frozen
    with pytest.raises(ConfigError, match="frozen .* fsdp2 train backend"):
        TrainBackendSpec(model_path="m", backend="fsdp2", frozen=True)


def test_a_sharded_critic_is_a_recipe_error() -> None:
    """The critic stays one torch rank beside a megatron policy: asking for a sharded one says
    so and what to do instead."""
    from roll_core.config.rlvr import CriticConfig

    with pytest.raises(ValidationError, match=r"critic.backend 'megatron' is not built: the "
                       r"critic is one torch rank .* remove critic.backend"):  # fmt: skip
        CriticConfig.model_validate({"backend": "megatron"})
    assert CriticConfig.model_validate({}).backend == "torch"
