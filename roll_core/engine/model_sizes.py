"""Model shapes for the memory estimate, known without downloading anything.

`model_shape(name)` reads the Hugging Face config of a built-in model, of a local model
directory, or of a hub id already in the local Hugging Face cache; for hub ids not cached it
falls back to `KNOWN_CONFIGS`, the published configs of the models our recipes name. The
network is never used: `--dry-run` works offline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from roll_core.models.loading import approx_vision_params

_QWEN3 = {"vocab_size": 151936, "head_dim": 128, "attention_bias": False}
_QWEN25_7B = {
    "num_hidden_layers": 28,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "attention_bias": True,
}
_QWEN25_VL_7B = {
    **_QWEN25_7B,
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "out_hidden_size": 3584,
    },
}
_QWEN25_VL_3B = {
    "num_hidden_layers": 36,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "vision_config": {
        **cast(dict[str, Any], _QWEN25_VL_7B["vision_config"]),
        "out_hidden_size": 2048,
    },
}
_QWEN3_30B_A3B = {
    **_QWEN3,
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}


def _qwen3(layers: int, hidden: int, inter: int, heads: int, kv: int, tie: bool) -> dict[str, Any]:
    return {
        **_QWEN3,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "tie_word_embeddings": tie,
    }


KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": _qwen3(28, 1024, 3072, 16, 8, True),
    "Qwen/Qwen3-1.7B": _qwen3(28, 2048, 6144, 16, 8, True),
    "Qwen/Qwen3-4B": _qwen3(36, 2560, 9728, 32, 8, True),
    "Qwen/Qwen3-8B": _qwen3(36, 4096, 12288, 32, 8, False),
    "Qwen/Qwen3-14B": _qwen3(40, 5120, 17408, 40, 8, False),
    "Qwen/Qwen3-32B": _qwen3(64, 5120, 25600, 64, 8, False),
    "Qwen/Qwen3-30B-A3B": _QWEN3_30B_A3B,
    "Qwen/Qwen2.5-7B": _QWEN25_7B,
    "Qwen/Qwen2.5-7B-Instruct": _QWEN25_7B,
    "Qwen/Qwen2.5-Math-7B": _QWEN25_7B,
    "Qwen/Qwen2.5-VL-3B-Instruct": _QWEN25_VL_3B,
    "Qwen/Qwen2.5-VL-7B-Instruct": _QWEN25_VL_7B,
}
"""Published config.json fields of the hub models the recipes use (`-Base` variants share
them)."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs of a decoder-only (dense or MoE) transformer."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    attention_bias: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    experts_per_token: int = 0
    vision_params: int = 0
    """Parameters of a vision-language model's vision tower (0: a text model)."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return cls(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            tie_embeddings=bool(text.get("tie_word_embeddings", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            num_experts=int(text.get("num_experts") or text.get("num_local_experts") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            experts_per_token=int(text.get("num_experts_per_tok") or 0),
            vision_params=approx_vision_params(config.get("vision_config")) or 0,
        )

    @property
    def params(self) -> int:
        """Parameter count (tied embeddings once; norms included)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.num_experts:
            mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size
        norms = 2 * h + 2 * d  # input / post-attention norms, q / k norms (Qwen3)
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + h + self.vision_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (MoE: only its experts)."""
        if not self.num_experts:
            return self.params
        unused = self.num_experts - self.experts_per_token
        return (
            self.params
            - self.num_layers * unused * 3 * self.hidden_size * self.moe_intermediate_size
        )

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache of one token over all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def model_config(name_or_path: str) -> dict[str, Any] | None:
    """The model's config.json as a dict, from disk or the table; None when unknown."""
    from roll_core.models.builtin import BUILTIN_PREFIX, get_builtin

    if name_or_path.startswith(BUILTIN_PREFIX):
        return dict(get_builtin(name_or_path).config_dict())
    local = Path(name_or_path).expanduser() / "config.json"
    if local.is_file():
        return dict(json.loads(local.read_text(encoding="utf-8")))
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json")
        if isinstance(cached, str):
            return dict(json.loads(Path(cached).read_text(encoding="utf-8")))
    except (ValueError, OSError):
        pass
    base = name_or_path.removesuffix("-Base")
    return dict(KNOWN_CONFIGS[base]) if base in KNOWN_CONFIGS else None


def model_shape(name_or_path: str) -> ModelShape | None:
    config = model_config(name_or_path)
    if config is None:
        return None
    try:
        return ModelShape.from_config(config)
    except (KeyError, TypeError, ValueError):
        return None
