"""The train-backend registry, the DeepSpeed config we build, and the missing-install error
(no processes started)."""

from __future__ import annotations

import sys

import pytest

from roll_core.backends.train import get_train_backend
from roll_core.backends.train.deepspeed_backend import ds_config, import_deepspeed
from roll_core.config.schema import ActorTrainConfig, DeepSpeedConfig
from roll_core.errors import ConfigError


def test_registry_lists_valid_names() -> None:
    assert get_train_backend("fsdp2").__name__ == "FSDP2TrainBackend"
    with pytest.raises(
        ConfigError, match="unknown train backend 'jax'; valid: torch, fsdp2, deepspeed, megatron"
    ):
        get_train_backend("jax")


def test_missing_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ConfigError, match="not installed") as err:
        import_deepspeed()
    assert ".[deepspeed]" in (err.value.hint or "")


def test_ds_config_zero3_with_offload() -> None:
    cfg = ds_config(
        DeepSpeedConfig(zero_stage=3, offload_optimizer=True, offload_param=True),
        micro_batch_size=2,
        world_size=4,
        max_grad_norm=1.0,
        bf16=True,
    )
    assert cfg["train_batch_size"] == 8  # micro 2 x 4 ranks x 1 accumulation step
    assert cfg["managed_gradient_accumulation"] is False  # we accumulate; step() once
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"] == {"enabled": True}
    no_clip = ds_config(
        DeepSpeedConfig(), micro_batch_size=1, world_size=1, max_grad_norm=None, bf16=False
    )
    assert (
        no_clip["gradient_clipping"] == 0.0
        and "offload_optimizer" not in no_clip["zero_optimization"]
    )


def test_conflicting_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="offload_param needs zero_stage 3"):
        DeepSpeedConfig(zero_stage=2, offload_param=True)
    with pytest.raises(ValueError, match="needs a multi-rank backend"):
        ActorTrainConfig(world_size=2)
    with pytest.raises(ValueError, match="supported by the torch backend only"):
        ActorTrainConfig(backend="fsdp2", lora={})
    with pytest.raises(ValueError, match="device_mapping lists 2"):
        ActorTrainConfig(backend="fsdp2", world_size=4, device_mapping=[0, 1])
