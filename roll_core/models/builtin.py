"""Built-in tiny models in the Qwen3 architecture, addressed as ``builtin:NAME``.

A built-in model is a registry entry (:data:`BUILTIN_MODELS`) until something needs its files;
then :func:`materialize_builtin` writes a real Hugging Face model directory (config, generation
config, safetensors weights, tokenizer with chat template) into the roll cache, once. The weights
are the random initialisation under ``torch.manual_seed(0)`` in float32, and writing them again
gives byte-identical files, so a builtin name means the same model on every machine.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from roll_core.errors import ModelError
from roll_core.models.builtin_vlm import (
    VLM_ARCHITECTURE,
    VLM_MODEL_TYPE,
    vlm_config_dict,
    write_vlm_dir,
)
from roll_core.models.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    build_tokenizer,
    padded_vocab_size,
    save_tokenizer,
    tokenizer_size,
)

BUILTIN_PREFIX = "builtin:"
# Bump when the files a builtin materializes to change (tokenizer, init, config), so old caches
# are never mistaken for new ones.
BUILTIN_FORMAT_VERSION = 1
ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"
INIT_SEED = 0

# Settings every builtin shares (Qwen3 defaults made explicit).
_COMMON_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "rope_theta": 10000.0,
    }
)


@dataclass(frozen=True)
class BuiltinSpec:
    """One built-in model: its name, a one-line description and its config kwargs
    (``Qwen3Config``; for ``family="qwen2.5-vl"`` the language model's, with the vision
    tower's in ``vision_kwargs``)."""

    name: str
    description: str
    config_kwargs: Mapping[str, Any]
    family: str = "qwen3"
    vision_kwargs: Mapping[str, Any] | None = None

    @property
    def is_vision(self) -> bool:
        return self.vision_kwargs is not None

    @property
    def architecture(self) -> str:
        return VLM_ARCHITECTURE if self.is_vision else ARCHITECTURE

    @property
    def model_type(self) -> str:
        return VLM_MODEL_TYPE if self.is_vision else MODEL_TYPE

    def config_dict(self) -> dict[str, Any]:
        """All config kwargs of this model, vocab size and special token ids included
        (a VLM's nested as ``text_config`` / ``vision_config``)."""
        if self.vision_kwargs is not None:
            return vlm_config_dict(self.config_kwargs, self.vision_kwargs)
        return {
            **_COMMON_CONFIG,
            **self.config_kwargs,
            "vocab_size": padded_vocab_size(tokenizer_size()),
        }


def _spec(name: str, description: str, **config_kwargs: Any) -> BuiltinSpec:
    return BuiltinSpec(name, description, MappingProxyType(config_kwargs))


#: The vision tower of the built-in VLMs: 2 blocks x 64, patch 14, merge 2 (a 56x56 image is
#: 16 patches, 4 image tokens). Shared by the tiny VLM and its distillation teacher, which must
#: agree on the image processor and image tokens.
_TINY_VISION_TOWER = MappingProxyType(
    dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        in_channels=3,
    )
)

_TINY_QWEN3: dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    tie_word_embeddings=True,
)
"""tiny-qwen3's shape, shared by its long-context twin (same weights: the context length
changes no parameter)."""

BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    spec.name: spec
    for spec in (
        _spec(
            "tiny-qwen3",
            "Qwen3, 2 layers, hidden 128 (~0.43M params): the default model of CPU recipes.",
            **_TINY_QWEN3,
            max_position_embeddings=512,
        ),
        _spec(
            "tiny-qwen3-8k",
            "tiny-qwen3 with an 8,192-token context: a real agent harness's prompts (a few "
            "thousand bytes) fit on CPU.",
            **_TINY_QWEN3,
            max_position_embeddings=8192,
        ),
        _spec(
            "small-qwen3",
            "Qwen3, 4 layers, hidden 256 (~3.2M params): a teacher for distillation on CPU.",
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            intermediate_size=768,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
        ),
        BuiltinSpec(
            "tiny-qwen2.5-vl",
            "Qwen2.5-VL, vision tower 2 layers x 64 (patch 14, merge 2), LM 2 layers x 128 "
            "(~0.69M params): the vision-language model of CPU recipes.",
            MappingProxyType(
                dict(
                    hidden_size=128,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    intermediate_size=384,
                    tie_word_embeddings=True,
                    max_position_embeddings=1024,
                )
            ),
            family="qwen2.5-vl",
            vision_kwargs=_TINY_VISION_TOWER,
        ),
        BuiltinSpec(
            "small-qwen2.5-vl",
            "Qwen2.5-VL, the tiny VLM's vision tower and image processor, LM 4 layers x 256 "
            "(~3.5M params): a vision-language teacher for distillation on CPU.",
            MappingProxyType(
                dict(
                    hidden_size=256,
                    num_hidden_layers=4,
                    num_attention_heads=8,
                    num_key_value_heads=4,
                    intermediate_size=768,
                    tie_word_embeddings=True,
                    max_position_embeddings=1024,
                )
            ),
            family="qwen2.5-vl",
            vision_kwargs=_TINY_VISION_TOWER,
        ),
    )
}


def get_builtin(name: str) -> BuiltinSpec:
    """The spec of builtin ``name`` (with or without the ``builtin:`` prefix)."""
    name = name.removeprefix(BUILTIN_PREFIX)
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    valid = ", ".join(sorted(BUILTIN_MODELS))
    close = difflib.get_close_matches(name, BUILTIN_MODELS, n=1)
    suggestion = f"Did you mean 'builtin:{close[0]}'? " if close else ""
    raise ModelError(
        f"unknown built-in model 'builtin:{name}'. The built-in models are: {valid}.",
        hint=f"{suggestion}Write the model as builtin:NAME with one of those names, "
        "or give a local model directory or a Hugging Face hub id instead.",
    )


def default_cache_dir() -> Path:
    """The roll cache: ``$ROLL_CACHE_DIR`` if set, else ``~/.cache/roll``."""
    env = os.environ.get("ROLL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "roll"


def builtin_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where builtin ``name`` is (or would be) materialized; nothing is written."""
    spec = get_builtin(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "builtin" / f"{spec.name}-v{BUILTIN_FORMAT_VERSION}"


def materialize_builtin(name: str, cache_dir: Path | None = None) -> Path:
    """Write builtin ``name`` as a Hugging Face model directory (once) and return its path.

    The directory is written into a temporary sibling and renamed into place, so a reader never
    sees a half-written model; if another process renamed its copy first, that copy is used.
    """
    target = builtin_dir(name, cache_dir)
    if target.is_dir():
        return target
    spec = get_builtin(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        _write_model_dir(spec, tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_model_dir(spec: BuiltinSpec, directory: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config_kwargs = spec.config_dict()
    if spec.is_vision:
        with _no_progress_bars():
            write_vlm_dir(
                config_kwargs,
                directory,
                seed=INIT_SEED,
                max_positions=spec.config_kwargs["max_position_embeddings"],
            )
        return
    tokenizer = build_tokenizer(model_max_length=config_kwargs["max_position_embeddings"])
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen3Config(**config_kwargs, pad_token_id=pad_id, eos_token_id=eos_id, dtype="float32")  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        model = Qwen3ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    with _no_progress_bars():
        model.save_pretrained(directory)
    save_tokenizer(tokenizer, directory)
    _add_legacy_rope_theta(directory / "config.json", config_kwargs["rope_theta"])


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _add_legacy_rope_theta(config_file: Path, rope_theta: float) -> None:
    # transformers 5 writes rope_theta only inside rope_parameters; transformers 4 (and engines
    # built on it) read the top-level key and would otherwise fall back to Qwen3's 1e6.
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.setdefault("rope_theta", rope_theta)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    config_file.write_text(text, encoding="utf-8")
