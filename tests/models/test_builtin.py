"""Built-in models: registry, materialization (deterministic, atomic), the weights' shapes."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from roll_core.errors import ModelError
from roll_core.models import builtin
from roll_core.models.builtin import (
    BUILTIN_MODELS,
    builtin_dir,
    default_cache_dir,
    get_builtin,
    materialize_builtin,
)
from roll_core.models.loading import count_parameters

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}

# Parameter counts, by hand (vocab V = 320, tied embeddings so no separate lm_head):
# tiny-qwen3: H=128, 2 layers, 4 heads x 32, 2 kv heads x 32, MLP 384.
#   embed 320*128 = 40_960
#   per layer: q 128*128 + k 128*64 + v 128*64 + o 128*128 = 49_152; q/k norms 32+32 = 64;
#              gate/up/down 3*128*384 = 147_456; 2 RMSNorms 2*128 = 256  -> 196_928
#   total 40_960 + 2*196_928 + final norm 128 = 434_944
# small-qwen3: H=256, 4 layers, 8 heads x 32, 4 kv heads x 32, MLP 768.
#   embed 320*256 = 81_920
#   per layer: attn 65_536 + 32_768 + 32_768 + 65_536 = 196_608; norms 64;
#              MLP 3*256*768 = 589_824; 2*256 = 512  -> 787_008
#   total 81_920 + 4*787_008 + 256 = 3_230_208
EXPECTED_PARAMS = {"tiny-qwen3": 434_944, "tiny-qwen3-8k": 434_944, "small-qwen3": 3_230_208}


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def test_registry_specs() -> None:
    assert {"tiny-qwen3", "small-qwen3"} <= set(BUILTIN_MODELS)
    for name, spec in BUILTIN_MODELS.items():
        assert spec.name == name and spec.description
        if spec.is_vision:  # tests/models/test_vlm.py
            text = spec.config_dict()["text_config"]
            assert text["hidden_size"] // text["num_attention_heads"] >= 32
            assert text["vocab_size"] % 64 == 0
            continue
        config = spec.config_dict()
        assert config["head_dim"] >= 32  # vLLM's CPU attention fails below 32
        assert config["vocab_size"] % 64 == 0
        assert config["tie_word_embeddings"] is True
        assert config["rms_norm_eps"] == 1e-6 and config["attention_bias"] is False


def test_materialize_writes_a_hf_model_dir(tiny_dir: Path) -> None:
    assert tiny_dir.name == "tiny-qwen3-v1" and tiny_dir.parent.name == "builtin"
    assert {p.name for p in tiny_dir.iterdir()} == EXPECTED_FILES
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.dtype == torch.float32
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    assert model.config.max_position_embeddings == 512
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (
        258,
        256,
    )


def test_rematerializing_is_byte_identical(tmp_path: Path, tiny_dir: Path) -> None:
    again = materialize_builtin("tiny-qwen3", tmp_path)
    assert again != tiny_dir
    assert _digests(again) == _digests(tiny_dir)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_param_counts_and_forward(tmp_path: Path, name: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(materialize_builtin(name, tmp_path))
    assert count_parameters(model) == EXPECTED_PARAMS[name]
    input_ids = torch.tensor([[257, 117, 10, 49, 43, 49], [49, 50, 51, 52, 53, 54]])
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (2, 6, 320)
    assert torch.isfinite(logits).all()


def test_materialize_is_done_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = materialize_builtin("tiny-qwen3", tmp_path)

    def fail(*args: object) -> None:
        raise AssertionError("materialized twice")

    monkeypatch.setattr(builtin, "_write_model_dir", fail)
    assert materialize_builtin("tiny-qwen3", tmp_path) == first
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left


def test_materialize_uses_the_copy_of_a_process_that_won_the_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = builtin._write_model_dir
    target = builtin_dir("tiny-qwen3", tmp_path)

    def write_then_lose_race(spec: builtin.BuiltinSpec, directory: Path) -> None:
        write(spec, directory)
        shutil.copytree(directory, target)  # the other process renames its copy first
        (target / "winner").touch()

    monkeypatch.setattr(builtin, "_write_model_dir", write_then_lose_race)
    assert materialize_builtin("tiny-qwen3", tmp_path) == target
    assert (target / "winner").exists()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_materialize_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    materialize_builtin("tiny-qwen3", tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_builtin_lists_names_and_suggests() -> None:
    with pytest.raises(ModelError) as err:
        get_builtin("tiny-qwen")
    message = str(err.value)
    assert "tiny-qwen3" in message and "small-qwen3" in message
    assert "Did you mean 'builtin:tiny-qwen3'?" in message


def test_cache_dir_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert builtin_dir("builtin:tiny-qwen3") == tmp_path / "c" / "builtin" / "tiny-qwen3-v1"
    monkeypatch.delenv("ROLL_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "roll"
