"""Tiny Hugging Face models of every supported architecture, written by save_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

#: Per architecture: the HF config of a tiny model (4 layers for pp=2, 2 kv heads for tp=2,
#: a vocabulary of 250 so Megatron pads it; Qwen3 with head_dim != hidden / heads; Qwen3-MoE and
#: Qwen2-MoE with 4 experts).
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, head_dim=16, rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=24, rope_theta=1000000.0),
    # 4 experts (2 per rank at ep=2), top-2, expert size 32 (split by tp=2)
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        tie_word_embeddings=False,
        head_dim=16,
        rope_theta=1000000.0,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    # Qwen2-MoE: q/k/v bias, tied, softmax over all experts (no renormalisation), and a
    # shared expert of size 48 behind a sigmoid gate
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
    ),
}
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=250,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def make_hf_model(arch: str, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Save a randomly initialised tiny ``arch`` model (every tensor random, norms too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**COMMON, **TINY_CONFIGS[arch]}
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1 and biases at 0: hide nothing
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    model.to(dtype).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny float32 HF model directory per architecture."""
    root = tmp_path_factory.mktemp("hf-models")
    return {arch: make_hf_model(arch, root / arch) for arch in TINY_CONFIGS}
