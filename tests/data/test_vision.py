"""Image values of dataset rows, and per-sample vision inputs travelling in a Batch."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from roll_core.data import Batch
from roll_core.data.shapes import draw_scene, make_scene, write_shapes_dataset
from roll_core.data.vision import (
    BadImageError,
    VisionInputs,
    concat_vision,
    image_rows,
    read_images,
    sample_vision,
    token_type_ids,
    vision_fields,
    vision_model_inputs,
)


def _png(mode: str = "RGB", size: tuple[int, int] = (10, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def test_read_images_accepts_paths_bytes_dicts_and_pil(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png("L"))  # greyscale: converted to RGB
    pil = Image.new("RGBA", (3, 3))
    got = read_images(
        ["img/a.png", _png(), {"bytes": _png(), "path": None}, {"path": "img/a.png"}, pil],
        base_dir=tmp_path,
        column="images",
    )
    assert [im.mode for im in got] == ["RGB"] * 5
    assert got[0].size == (10, 6) and got[4].size == (3, 3)
    assert read_images(None, base_dir=tmp_path, column="images") == []
    assert len(read_images("img/a.png", base_dir=tmp_path, column="images")) == 1


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("missing.png", "does not exist"),
        (b"not an image", "not a readable image"),
        ({"other": 1}, "needs 'bytes' or 'path'"),
        (3.5, "cannot read a float"),
    ],
)
def test_bad_images_raise_a_data_error_naming_the_column(
    tmp_path: Path, value: object, words: str
) -> None:
    (tmp_path / "broken.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(BadImageError, match=words) as err:
        read_images(value, base_dir=tmp_path, column="pics")
    assert "'pics'" in err.value.message
    with pytest.raises(BadImageError, match="not a readable image"):
        read_images("broken.png", base_dir=tmp_path, column="pics")


def _vision(n_patches: int, n_images: int, fill: float) -> VisionInputs:
    grid = torch.tensor([[1, 2, n_patches // (2 * n_images)]] * n_images)
    return VisionInputs(torch.full((n_patches, 6), fill), grid)


def test_vision_inputs_travel_with_their_rows_through_select_split_concat() -> None:
    # rows 0 and 2 have images (8 and 4 patches), row 1 is text only
    vis = [_vision(8, 2, 1.0), None, _vision(4, 1, 3.0)]
    batch = Batch(tensors={"input_ids": torch.arange(3).view(3, 1)}, non_tensors=vision_fields(vis))
    assert sample_vision(batch, 1) is None and sample_vision(batch, 2).equal(vis[2])
    picked = batch.select([2, 0])
    assert sample_vision(picked, 0).equal(vis[2]) and sample_vision(picked, 1).equal(vis[0])
    joined = Batch.concat(batch.split(2)[::-1])  # rows 2, 0, 1
    assert joined.tensors["input_ids"].flatten().tolist() == [2, 0, 1]
    assert sample_vision(joined, 0).equal(vis[2]) and sample_vision(joined, 2) is None
    # the model input: patches concatenated in row order, one grid row per image
    model_in = vision_model_inputs(joined)
    assert model_in["pixel_values"].shape == (12, 6)
    assert model_in["pixel_values"][:4].eq(3.0).all() and model_in["pixel_values"][4:].eq(1.0).all()
    assert model_in["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2], [1, 2, 2]]
    assert vision_fields([None, None]) == {} and concat_vision([None]) == {}
    # 2x2 merge: a (1, 2, 4) grid is 8 patches = 2 image tokens
    assert _vision(8, 1, 0.0).num_image_tokens(2) == [2]


def test_token_types_mark_image_placeholders_for_the_3d_rope() -> None:
    # id 9 is the image placeholder; row 1 is text only, 0 is padding
    ids = torch.tensor([[1, 9, 9, 2, 0], [3, 4, 5, 0, 0]])
    assert token_type_ids(ids, 9).tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    batch = Batch(tensors={"input_ids": ids}, non_tensors=vision_fields([_vision(8, 1, 1.0), None]))
    model_in = vision_model_inputs(batch, image_token_id=9)
    assert model_in["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert "mm_token_type_ids" not in vision_model_inputs(batch)  # no token id: none built
    text_only = Batch(tensors={"input_ids": ids}, non_tensors=vision_fields([None, None]))
    assert vision_model_inputs(text_only, image_token_id=9) == {}  # no image: no kwargs
    with pytest.raises(ValueError, match="both input_ids and image_token_id"):
        concat_vision([_vision(8, 1, 1.0)], input_ids=ids[:1])


def test_model_forward_refuses_images_without_token_types() -> None:
    from roll_core.backends.train.packing import model_forward

    batch = Batch(
        tensors={"input_ids": torch.tensor([[1, 9, 2]]), "attention_mask": torch.ones(1, 3)},
        non_tensors=vision_fields([_vision(4, 1, 1.0)]),
    )
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        model_forward(
            lambda **kw: None,
            batch,
            torch.device("cpu"),
            packing=False,
            vision=vision_model_inputs(batch),
        )


def test_shapes_dataset_is_deterministic_and_test_images_are_not_in_train(tmp_path: Path) -> None:
    a = write_shapes_dataset(tmp_path / "a", n_train=40, n_test=10, seed=3)
    b = write_shapes_dataset(tmp_path / "b", n_train=40, n_test=10, seed=3)
    for split in ("train", "test"):
        assert a[split].read_bytes() == b[split].read_bytes()
    png = sorted(p.name for p in (tmp_path / "a" / "images").iterdir())
    assert len(png) == 50
    assert all(
        (tmp_path / "a/images" / n).read_bytes() == (tmp_path / "b/images" / n).read_bytes()
        for n in png
    )
    train = {(tmp_path / "a/images" / n).read_bytes() for n in png if n.startswith("train")}
    test = {(tmp_path / "a/images" / n).read_bytes() for n in png if n.startswith("test")}
    assert not train & test
    import random

    scene = make_scene(random.Random(0), 4)
    image = draw_scene(scene)
    # every square's pixels are its colour; the count is the number of squares
    lit = sum(1 for px in image.getdata() if px != (0, 0, 0))
    assert lit == sum(side * side for _, _, _, side, _ in scene)


def test_image_rows_of_a_text_model_name_the_model_and_column(tmp_path: Path) -> None:
    import datasets

    from roll_core.errors import DataError

    ds = datasets.Dataset.from_list([{"prompt": "p", "pics": ["a.png"]}])
    with pytest.raises(DataError, match="'pics'.*builtin:tiny-qwen3 is a text-only"):
        image_rows(
            ds, column="pics", processor=None, data_path="d.parquet", model="builtin:tiny-qwen3"
        )
    # no such column, or an empty one: text rows
    assert image_rows(ds, column="images", processor=None, data_path="d", model="m") is None
    empty = datasets.Dataset.from_list([{"prompt": "p", "pics": []}])
    assert image_rows(empty, column="pics", processor=None, data_path="d", model="m") is None
    rows = image_rows(
        ds, column="pics", processor=object(), data_path=str(tmp_path / "x.jsonl"), model="m"
    )
    assert rows is not None and rows.base_dir is None  # x.jsonl does not exist
    (tmp_path / "x.jsonl").write_text("{}\n")
    rows = image_rows(
        ds, column="pics", processor=object(), data_path=str(tmp_path / "x.jsonl"), model="m"
    )
    assert rows is not None and rows.base_dir == tmp_path
