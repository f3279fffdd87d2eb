"""The tiny visual data set of the vision-language recipes: count the squares in an image.

Every row is one 56x56 RGB image (a PNG next to the data file) with 1 to ``max_count`` (4) filled
squares on a black background, and the question how many there are::

    {"images": ["images/train-00012.png"], "prompt": "How many squares?",
     "response": "3", "answer": "3", "domain": "math"}

* The image is a 2x2 grid of 28-pixel cells, one cell per image token of the tiny VLM (patch
  14, 2x2 patches merged); each square (8 to 20 pixels wide, one of six colours) lies inside
  its own cell at a random offset, so the squares never overlap and the answer is the number
  of non-empty cells. (A 4x4 grid of 14-pixel cells, four squares per token, was not learnt
  by the tiny model within minutes: SFT stayed at chance.)
* Counts are uniform over 1..max_count; which cells hold squares is uniform too.
* Randomness comes only from :meth:`random.Random.random` (stable across Python versions) and
  PNGs are written by Pillow without metadata, so a seed gives the same files everywhere;
  ``data/tiny-shapes/`` is ``write_shapes_dataset("data/tiny-shapes")`` (seed 0). Test images
  are unique and never appear in train (the same cells, offsets, sizes and colours).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

IMAGE_SIZE = 56
CELL = 28
GRID = IMAGE_SIZE // CELL
COLOURS = (
    (255, 64, 64),
    (64, 255, 64),
    (64, 128, 255),
    (255, 255, 64),
    (255, 64, 255),
    (64, 255, 255),
)
PROMPT = "How many squares?"

Scene = tuple[tuple[int, int, int, int, int], ...]
"""(cell, dx, dy, side, colour index) of every square, by cell."""


def make_scene(rng: random.Random, max_count: int) -> Scene:
    count = 1 + int(rng.random() * max_count)
    cells = list(range(GRID * GRID))
    chosen = []
    for _ in range(count):
        chosen.append(cells.pop(int(rng.random() * len(cells))))
    squares = []
    for cell in sorted(chosen):
        side = 8 + int(rng.random() * 13)
        dx, dy = int(rng.random() * (CELL - side + 1)), int(rng.random() * (CELL - side + 1))
        squares.append((cell, dx, dy, side, int(rng.random() * len(COLOURS))))
    return tuple(squares)


def draw_scene(scene: Scene) -> Any:
    """The scene as a 56x56 RGB ``PIL.Image``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    for cell, dx, dy, side, colour in scene:
        x, y = (cell % GRID) * CELL + dx, (cell // GRID) * CELL + dy
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[colour])
    return image


def write_shapes_dataset(
    out_dir: str | Path,
    *,
    n_train: int = 1000,
    n_test: int = 200,
    seed: int = 0,
    max_count: int = 4,
) -> dict[str, Path]:
    """Write ``train.jsonl``, ``test.jsonl`` and ``images/*.png`` into ``out_dir``."""
    if not 1 <= max_count <= GRID * GRID:
        raise ValueError(f"max_count must be in 1..{GRID * GRID}, got {max_count}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    test: list[Scene] = []
    seen: set[Scene] = set()
    while len(test) < n_test:
        scene = make_scene(rng, max_count)
        if scene not in seen:
            seen.add(scene)
            test.append(scene)
    train: list[Scene] = []
    while len(train) < n_train:
        scene = make_scene(rng, max_count)
        if scene not in seen:  # never a test image in train
            train.append(scene)
    paths = {}
    for split, scenes in (("train", train), ("test", test)):
        rows = []
        for i, scene in enumerate(scenes):
            name = f"images/{split}-{i:05d}.png"
            draw_scene(scene).save(out / name, format="PNG", optimize=False)
            answer = str(len(scene))
            rows.append(
                {
                    "images": [name],
                    "prompt": PROMPT,
                    "response": answer,
                    "answer": answer,
                    "domain": "math",
                }
            )
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths[split] = path
    return paths
