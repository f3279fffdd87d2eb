"""Resolving model names, loading models and tokenizers, error messages, dry-run summaries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList

from roll_core.errors import ModelError
from roll_core.models import (
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    model_summary,
    resolve_model_path,
)
from roll_core.models.tokenizer import build_tokenizer


def test_builtin_resolves_to_materialized_dir(cache_dir: Path) -> None:
    path = Path(resolve_model_path("builtin:tiny-qwen3"))
    assert path == cache_dir / "builtin" / "tiny-qwen3-v1"
    assert (path / "config.json").is_file()


def test_local_dir_resolves_to_absolute_path(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tiny_dir.parent)
    assert resolve_model_path(f"./{tiny_dir.name}") == str(tiny_dir.resolve())
    assert resolve_model_path(tiny_dir.name) == str(tiny_dir.resolve())


@pytest.mark.parametrize("hub_id", ["Qwen/Qwen3-0.6B", "gpt2"])
def test_hub_id_passes_through(hub_id: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(hub_id) == hub_id


@pytest.mark.parametrize("path", ["./no-model", "/no/such/model", "~/no-such-model", "a/b/c"])
def test_missing_local_path(path: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="model path not found"):
        resolve_model_path(path)


def test_path_under_an_existing_dir_is_local(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ModelError, match="model path not found: runs/typo"):
        resolve_model_path("runs/typo")


def test_dir_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").touch()
    with pytest.raises(ModelError, match=r"has no config\.json"):
        resolve_model_path(str(tmp_path))


def test_file_instead_of_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="is a file"):
        resolve_model_path(str(tmp_path / "config.json"))


def test_unknown_builtin(cache_dir: Path) -> None:
    with pytest.raises(ModelError, match="builtin:small-qwen") as err:
        load_causal_lm("builtin:smal-qwen3")
    assert "tiny-qwen3" in str(err.value)


def test_empty_name() -> None:
    with pytest.raises(ModelError, match="empty"):
        resolve_model_path(" ")


def test_load_builtin_model_and_tokenizer(cache_dir: Path) -> None:
    model = load_causal_lm("builtin:tiny-qwen3", dtype=torch.bfloat16)
    tokenizer = load_tokenizer("builtin:tiny-qwen3")
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    assert count_parameters(model) == 434_944
    ids = tokenizer("3+4=", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape == (1, 4, 320)


class _ForceEosAfter(LogitsProcessor):
    def __init__(self, prompt_len: int, steps: int, eos_id: int) -> None:
        self.stop_at, self.eos_id = prompt_len + steps - 1, eos_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] >= self.stop_at:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.eos_id] = 0.0
        return scores


def test_generation_stops_at_im_end(tiny_dir: Path) -> None:
    model, tokenizer = load_causal_lm(str(tiny_dir)), load_tokenizer(str(tiny_dir))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == eos_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    force = LogitsProcessorList([_ForceEosAfter(prompt.shape[1], 3, eos_id)])
    out = model.generate(prompt, max_new_tokens=10, do_sample=False, logits_processor=force)
    assert out.shape[1] == prompt.shape[1] + 3  # stopped at eos, well before 10 new tokens
    assert out[0, -1].item() == eos_id


def test_hub_failure_becomes_model_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", offline)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # the one-try probe says the hub answers; from_pretrained then fails (a connection drop)
    monkeypatch.setattr("roll_core.models.loading.hub_unreachable", lambda: None)
    for load in (load_tokenizer, load_causal_lm):
        with pytest.raises(ModelError, match="hub could not be reached") as err:
            load("some-org/some-model")
        assert "builtin:tiny-qwen3" in str(err.value)
        assert isinstance(err.value.__cause__, OSError)


def test_broken_local_dir_becomes_model_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ModelError, match="could not load the model from"):
        load_causal_lm(str(tmp_path))


def test_pad_token_falls_back_to_eos(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    no_pad = build_tokenizer()
    no_pad.pad_token = None
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: no_pad)
    tokenizer = load_tokenizer(str(tiny_dir))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


def test_summary_of_builtin_writes_nothing(cache_dir: Path) -> None:
    summary = model_summary("builtin:small-qwen3")
    assert summary == {
        "name": "builtin:small-qwen3",
        "source": "builtin",
        "architecture": "Qwen3ForCausalLM",
        "num_layers": 4,
        "hidden_size": 256,
        "vocab_size": 320,
        "approx_params": 3_230_208,
        "context": 1024,
    }
    assert not cache_dir.exists()


def test_summary_of_local_dir_reads_only_config(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")  # no weights at all
    summary = model_summary(str(tmp_path))
    assert summary["source"] == "local"
    assert summary["approx_params"] == 434_944
    assert (summary["num_layers"], summary["hidden_size"], summary["vocab_size"]) == (2, 128, 320)


def test_summary_of_hub_id_needs_no_network() -> None:
    summary = model_summary("roll-tests/not-a-cached-model")
    assert summary["source"] == "hub" and summary["name"] == "roll-tests/not-a-cached-model"
    assert summary["approx_params"] is None
