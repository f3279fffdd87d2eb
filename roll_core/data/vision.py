"""Images in roll: reading image values of dataset rows, and the per-sample vision inputs.

A sample of a vision-language model (Qwen2-VL / Qwen2.5-VL) is its token ids, where every image
is a run of ``<|image_pad|>`` tokens (one per merged patch), plus two tensors made by the
model's image processor from the same images:

* ``pixel_values`` ``[num_patches, C * temporal_patch * patch * patch]``: the patches of all the
  sample's images, concatenated (image after image);
* ``image_grid_thw`` ``[num_images, 3]``: each image's (t, h, w) grid in patches.

:class:`VisionInputs` holds the pair for ONE sample. In a :class:`~roll_core.data.Batch` they
travel as the per-sample non-tensor fields ``pixel_values`` and ``image_grid_thw`` (lists with
one tensor, or ``None`` for a text-only sample, per row), so ``select`` / ``split`` /
``concat`` / pickling keep every sample's images with its row. :func:`vision_model_inputs`
concatenates them for one forward pass, the layout the Qwen-VL models expect.

Positions: given the token ids and the model's ``image_token_id``, :func:`vision_model_inputs`
and :func:`concat_vision` also give ``mm_token_type_ids`` (:func:`token_type_ids`: 1 at every
``<|image_pad|>``, 0 elsewhere), from which the model computes its 3-D (t, h, w) rope positions
(mrope) for the image tokens, as the checkpoints were trained and as vLLM computes them.
Without them transformers falls back to plain 1-D positions. roll handles images only (no
video inputs, token type 2).

Image values of a row (:func:`read_images`) may be a path (relative paths are relative to the
data file's directory), raw bytes, a ``{"bytes": ..., "path": ...}`` dict (what
``datasets.Image`` stores), a ``PIL.Image.Image`` (a decoded ``datasets.Image`` column), or a
list of these (several images per row). Every image is converted to RGB. A file that is
missing or unreadable raises :class:`BadImageError`; the data loaders skip such rows and count
them (see docs/vlm.md).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roll_core.errors import DataError

if TYPE_CHECKING:
    from PIL.Image import Image

    from roll_core.data.batch import Batch

log = logging.getLogger(__name__)

VISION_FIELDS = ("pixel_values", "image_grid_thw")
"""The Batch non-tensor fields that carry a sample's vision inputs."""

IMAGE_TOKEN_TYPE = 1
"""The ``mm_token_type_ids`` value of an image placeholder token (text: 0; video, 2, is not
used: roll has no video inputs)."""


class BadImageError(DataError):
    """One image value of a row cannot be read (missing file, not an image, bad value)."""


@dataclass
class VisionInputs:
    """The image-processor output of one sample: every image's patches and grid sizes."""

    pixel_values: torch.Tensor
    """``[num_patches, patch_dim]`` float, the images' patches one after another."""
    image_grid_thw: torch.Tensor
    """``[num_images, 3]`` int64, (t, h, w) patches per image."""

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def num_image_tokens(self, merge_size: int) -> list[int]:
        """The ``<|image_pad|>`` tokens of each image: its patches over ``merge_size**2``."""
        return [int(n) // merge_size**2 for n in self.image_grid_thw.prod(dim=-1)]

    def equal(self, other: VisionInputs | None) -> bool:
        """Bitwise equality of both tensors (token-in/token-out checks)."""
        return (
            other is not None
            and torch.equal(self.pixel_values, other.pixel_values)
            and torch.equal(self.image_grid_thw, other.image_grid_thw)
        )


def vision_fields(inputs: Sequence[VisionInputs | None]) -> dict[str, list]:
    """The Batch non-tensor fields for samples with these vision inputs ({} if none has any)."""
    if all(v is None for v in inputs):
        return {}
    return {
        "pixel_values": [None if v is None else v.pixel_values for v in inputs],
        "image_grid_thw": [None if v is None else v.image_grid_thw for v in inputs],
    }


def sample_vision(batch: Batch, i: int) -> VisionInputs | None:
    """The vision inputs of sample ``i`` of ``batch`` (None: a text-only sample)."""
    if "pixel_values" not in batch.non_tensors:
        return None
    pixels = batch.non_tensors["pixel_values"][i]
    if pixels is None:
        return None
    return VisionInputs(pixels, batch.non_tensors["image_grid_thw"][i])


def vision_model_inputs(
    batch: Batch,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    image_token_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """``pixel_values`` / ``image_grid_thw`` of the whole batch concatenated in row order (the
    model's input layout), on ``device``; {} when no sample has an image. With
    ``image_token_id`` (the model config's), also ``mm_token_type_ids`` of the batch's
    ``input_ids`` (:func:`token_type_ids`): what the model needs for its 3-D rope positions."""
    return concat_vision(
        [sample_vision(batch, i) for i in range(len(batch))],
        device=device,
        dtype=dtype,
        input_ids=batch.tensors["input_ids"] if image_token_id is not None else None,
        image_token_id=image_token_id,
    )


def concat_vision(
    inputs: Sequence[VisionInputs | None],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    image_token_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """The model keyword arguments for samples with these vision inputs, in order. With
    ``input_ids`` ``[B, T]`` (the rows' ids, any padding) and ``image_token_id``, also their
    ``mm_token_type_ids`` (:func:`token_type_ids`)."""
    if (input_ids is None) != (image_token_id is None):
        raise ValueError("concat_vision: give both input_ids and image_token_id, or neither")
    present = [v for v in inputs if v is not None and v.num_images]
    if not present:
        return {}
    pixels = torch.cat([v.pixel_values for v in present])
    grid = torch.cat([v.image_grid_thw for v in present])
    out = {
        "pixel_values": pixels.to(device=device, dtype=dtype or pixels.dtype),
        "image_grid_thw": grid.to(device=device),
    }
    if input_ids is not None and image_token_id is not None:
        out["mm_token_type_ids"] = token_type_ids(input_ids, image_token_id).to(device=device)
    return out


def token_type_ids(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``mm_token_type_ids`` of ``input_ids`` (same shape, int32): :data:`IMAGE_TOKEN_TYPE` at
    every image placeholder (``image_token_id``), 0 elsewhere (text and padding). Qwen2.5-VL's
    ``get_rope_index`` gives each run of image tokens the (t, h, w) positions of its image's
    grid, every later token continuing after the image's largest position."""
    return (input_ids == image_token_id).to(torch.int32) * IMAGE_TOKEN_TYPE


# -- reading images ---------------------------------------------------------------------------


def read_images(value: Any, *, base_dir: Path | None, column: str) -> list[Image]:
    """The RGB images of one row's image value (see the module docstring for the forms)."""
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [_read_one(v, base_dir=base_dir, column=column) for v in items]


def _read_one(value: Any, *, base_dir: Path | None, column: str) -> Image:
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return _rgb(value)
    if isinstance(value, dict):
        if value.get("bytes"):
            return _read_one(bytes(value["bytes"]), base_dir=base_dir, column=column)
        if value.get("path"):
            return _read_one(str(value["path"]), base_dir=base_dir, column=column)
        raise BadImageError(
            f"image column {column!r}: a dict value needs 'bytes' or 'path', got {sorted(value)}."
        )
    where = "image value"
    try:
        if isinstance(value, (bytes, bytearray)):
            where = "image bytes"
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str):
            path = Path(value).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            where = f"image file {str(path)!r}"
            if not path.is_file():
                raise BadImageError(f"image column {column!r}: {where} does not exist.")
            image = Image.open(path)
        else:
            raise BadImageError(
                f"image column {column!r}: cannot read a {type(value).__name__} as an image; "
                "give a path, bytes, a {'bytes'|'path'} dict or a datasets.Image value."
            )
        image.load()
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise BadImageError(
            f"image column {column!r}: {where} is not a readable image ({err})."
        ) from err
    return _rgb(image)


def _rgb(image: Image) -> Image:
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass
class ImageRows:
    """How a loader reads one dataset's image column for a vision-language model."""

    column: str
    """The image column (``data.image_key``)."""
    processor: Any
    """The model's :class:`~roll_core.models.vision.VisionProcessor`."""
    base_dir: Path | None
    """Relative image paths are relative to this (the data file's directory)."""
    bad: list[str] = field(default_factory=list)
    """The first few messages of rows skipped for an unreadable image."""

    def read(self, value: Any) -> list[Image]:
        return read_images(value, base_dir=self.base_dir, column=self.column)

    def warn(self, index: int, err: BadImageError) -> None:
        if len(self.bad) < MAX_BAD_IMAGE_MESSAGES:
            self.bad.append(f"row {index}: {err.message}")
            log.warning("skipping row %d: %s", index, err.message)


MAX_BAD_IMAGE_MESSAGES = 5


def image_rows(
    ds: Any, *, column: str, processor: Any | None, data_path: str, model: str
) -> ImageRows | None:
    """The :class:`ImageRows` of dataset ``ds`` when it has the image column ``column`` (None:
    a text dataset). A text-only model (``processor`` None) given image rows is a DataError
    naming the model and the column."""
    if column not in ds.column_names:
        return None
    if not any(v not in (None, [], "") for v in ds[column]):
        return None  # the column is there but holds no image
    if processor is None:
        raise DataError(
            f"{data_path} has images in column {column!r}, but the model {model} is a text-only "
            "model.",
            hint="Use a vision-language model (builtin:tiny-qwen2.5-vl, Qwen2.5-VL, Qwen2-VL), "
            f"or point data.image_key at another column (or drop the column {column!r}).",
        )
    local = Path(data_path).expanduser()
    base = (local if local.is_dir() else local.parent) if local.exists() else None
    return ImageRows(column, processor, base)
