"""The built-in tiny vision-language model ``builtin:tiny-qwen2.5-vl`` (Qwen2.5-VL architecture).

A two-layer vision tower (hidden 64, patch 14, spatial merge 2: a 56x56 image is 4x4 patches,
merged into 2x2 = 4 image tokens) in front of a two-layer Qwen2.5-VL language model of hidden
128. The tokenizer is the byte-level tokenizer of the text builtins (token id == byte value)
extended with Qwen-VL's special tokens (``<|vision_start|>``, ``<|image_pad|>``, ...), and the
chat template is ChatML that writes ``<|vision_start|><|image_pad|><|vision_end|>`` for every
``{"type": "image"}`` part of a message. The model, the tokenizer, the (PIL, no torchvision)
image processor and the processor are saved with ``save_pretrained``, so the directory loads
through ``AutoProcessor`` / ``AutoModelForImageTextToText.from_pretrained`` like a hub model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

from roll_core.models.tokenizer import (
    EOS_TOKEN,
    NUM_BYTE_TOKENS,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_tokenizer,
    padded_vocab_size,
    save_tokenizer,
)

VLM_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
VLM_MODEL_TYPE = "qwen2_5_vl"

VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
VISION_PAD_TOKEN = "<|vision_pad|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
VISION_TOKENS: tuple[str, ...] = (
    VISION_START_TOKEN,
    VISION_END_TOKEN,
    VISION_PAD_TOKEN,
    IMAGE_PAD_TOKEN,
    VIDEO_PAD_TOKEN,
)

# ChatML (as the text builtins) where a message's content may be a list of parts:
# {"type": "image"} -> the image placeholder, {"type": "text", "text": ...} -> the text.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Smallest and largest image the processor lets through, in pixels: smaller images are
# upscaled, larger ones downscaled (aspect kept, sides multiples of patch * merge = 28).
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112


def vlm_tokenizer_size() -> int:
    """``len(tokenizer)`` of the tiny VLM's tokenizer."""
    return NUM_BYTE_TOKENS + len(SPECIAL_TOKENS) + len(VISION_TOKENS)


def vlm_config_dict(lm: Mapping[str, Any], vision: Mapping[str, Any]) -> dict[str, Any]:
    """``Qwen2_5_VLConfig`` kwargs (text and vision configs nested) with the token ids."""
    ids = {t: NUM_BYTE_TOKENS + len(SPECIAL_TOKENS) + i for i, t in enumerate(VISION_TOKENS)}
    vocab = padded_vocab_size(vlm_tokenizer_size())
    pad_id, eos_id = SPECIAL_TOKENS.index(PAD_TOKEN), SPECIAL_TOKENS.index(EOS_TOKEN)
    head_dim = lm["hidden_size"] // lm["num_attention_heads"]
    quarter = head_dim // 8  # mrope: (temporal, height, width) sections of head_dim / 2
    text = {
        **lm,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2 * quarter, head_dim // 2 - 4 * quarter, 2 * quarter],
        },
        "bos_token_id": None,
        "pad_token_id": NUM_BYTE_TOKENS + pad_id,
        "eos_token_id": NUM_BYTE_TOKENS + eos_id,
    }
    return {
        "text_config": text,
        "vision_config": {**vision, "out_hidden_size": lm["hidden_size"]},
        "image_token_id": ids[IMAGE_PAD_TOKEN],
        "video_token_id": ids[VIDEO_PAD_TOKEN],
        "vision_start_token_id": ids[VISION_START_TOKEN],
        "vision_end_token_id": ids[VISION_END_TOKEN],
        "tie_word_embeddings": lm.get("tie_word_embeddings", True),
    }


def build_vlm_tokenizer(model_max_length: int) -> Any:
    """The byte-level builtin tokenizer plus the vision special tokens and the VL template."""
    tokenizer = build_tokenizer(model_max_length=model_max_length)
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS
            ]
        }
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    assert len(tokenizer) == vlm_tokenizer_size()
    return tokenizer


def write_vlm_dir(
    config_kwargs: Mapping[str, Any], directory: Path, *, seed: int, max_positions: int
) -> None:
    """Write model (random init under ``seed``, float32), tokenizer and processor."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = build_vlm_tokenizer(max_positions)
    config = Qwen2_5_VLConfig(**config_kwargs, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)  # type: ignore[arg-type]
    text = config_kwargs["text_config"]
    model.generation_config = GenerationConfig(
        eos_token_id=text["eos_token_id"], pad_token_id=text["pad_token_id"]
    )
    vision = config_kwargs["vision_config"]
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"],
        merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    model.save_pretrained(directory)
    save_tokenizer(tokenizer, directory)
    image_processor.save_pretrained(directory)
