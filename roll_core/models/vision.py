"""Vision-language models (Qwen2-VL, Qwen2.5-VL): recognising them and loading their processor.

A model is a vision-language model (VLM) when its ``config.json`` has a ``vision_config``
(:func:`is_vision_model`, read from the files: nothing is loaded). Its weights load through
:func:`~roll_core.models.loading.load_causal_lm` like a text model (which picks
``AutoModelForImageTextToText`` for VLMs). Its inputs are made by :class:`VisionProcessor`: the
model's tokenizer (with its chat template) and its image processor, loaded with
``AutoImageProcessor.from_pretrained(..., backend="pil")``, the PIL/numpy implementation that
needs no torchvision. roll does not build the model's ``AutoProcessor``: in transformers 5 the
Qwen-VL processors also construct a video processor, which needs torchvision; what the
processor adds on top of the two parts (one ``<|image_pad|>`` per merged patch) is done by
:func:`roll_core.data.chat.encode_chat_images`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from roll_core.data.vision import VisionInputs
from roll_core.errors import ModelError

SUPPORTED_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""``model_type`` values of the VLM families roll trains (image inputs as pixel_values +
image_grid_thw, one ``<|image_pad|>`` per merged patch)."""


@dataclass
class VisionProcessor:
    """A VLM's tokenizer and image processor, and the facts roll needs about them."""

    tokenizer: Any
    image_processor: Any
    image_token: str
    """The placeholder token one image is written as (``<|image_pad|>``), expanded to one per
    merged patch."""
    merge_size: int
    """Patches merged into one image token per side (Qwen-VL's ``spatial_merge_size``)."""

    def process_images(self, images: Sequence[Any]) -> VisionInputs:
        """The pixel values and grid sizes of ``images`` (RGB PIL images), one after another.
        Images larger than the processor's ``max_pixels`` are downscaled (smaller than
        ``min_pixels`` upscaled), aspect kept, as the model's own processor does."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return VisionInputs(out["pixel_values"], out["image_grid_thw"].long())


def load_processor(name_or_path: str, tokenizer: Any | None = None) -> VisionProcessor:
    """The :class:`VisionProcessor` of VLM ``name_or_path`` (``tokenizer``: one already loaded)."""
    from transformers import AutoImageProcessor

    from roll_core.models.loading import _load, load_tokenizer, model_config, resolve_model_path

    resolved = resolve_model_path(name_or_path)
    config = model_config(name_or_path)
    if config.get("model_type") not in SUPPORTED_VLM_TYPES:
        raise ModelError(
            f"{name_or_path} is a {config.get('model_type')!r} vision-language model; roll "
            f"handles the image inputs of {', '.join(SUPPORTED_VLM_TYPES)} models.",
            hint="Use a Qwen2-VL or Qwen2.5-VL model (builtin:tiny-qwen2.5-vl on CPU).",
        )
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(name_or_path)
    if not getattr(tokenizer, "chat_template", None):
        _adopt_processor_template(tokenizer, resolved)

    def from_pretrained(path: str, **kwargs: Any) -> Any:
        return AutoImageProcessor.from_pretrained(path, backend="pil", **kwargs)

    image_processor = _load("image processor", name_or_path, resolved, from_pretrained)
    image_id = config.get("image_token_id")
    token = tokenizer.convert_ids_to_tokens(int(image_id)) if image_id is not None else None
    if not token:
        raise ModelError(
            f"the tokenizer of {name_or_path} has no image placeholder token "
            f"(config image_token_id={image_id}).",
            hint="Use the tokenizer saved with the model (model.tokenizer unset).",
        )
    merge = int(getattr(image_processor, "merge_size", 0) or 2)
    return VisionProcessor(tokenizer, image_processor, str(token), merge)


def _adopt_processor_template(tokenizer: Any, resolved: str) -> None:
    """Hub VLMs may keep their chat template with the processor (``chat_template.json``)
    rather than the tokenizer: give it to the tokenizer, which renders every chat in roll."""
    import json
    from pathlib import Path

    directory = Path(resolved)
    if not directory.is_dir():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(resolved, "chat_template.json")
        if not isinstance(cached, str):
            return
        directory = Path(cached).parent
    jinja, packed = directory / "chat_template.jinja", directory / "chat_template.json"
    if jinja.is_file():
        tokenizer.chat_template = jinja.read_text(encoding="utf-8")
    elif packed.is_file():
        template = json.loads(packed.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            tokenizer.chat_template = template


def vision_token_ids(config: Any) -> list[int]:
    """Ids a VLM must never generate: the image / video placeholders and the vision start
    token. A sampled ``<|image_pad|>`` would be a placeholder with no image behind it when the
    sequence is trained on (the model's forward refuses such a batch); the generators suppress
    these ids (their logits are -inf while sampling; log-probs are of the raw logits)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id")
    return sorted({int(i) for n in names if (i := getattr(config, n, None)) is not None})


def image_token_id(config: Any) -> int | None:
    """The image placeholder id of a VLM's config (``<|image_pad|>``), None for a text model:
    with it the forwards build ``mm_token_type_ids`` (roll_core/data/vision.py), so the model
    uses its 3-D (mrope) positions for image tokens."""
    value = getattr(config, "image_token_id", None)
    return None if value is None else int(value)
