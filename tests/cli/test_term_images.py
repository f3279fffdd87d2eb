"""Inline pictures in the terminal: protocol detection and the escape sequences."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from roll_cli.term_images import detect_protocol, inline_image, sixel


@pytest.mark.parametrize(
    ("environ", "isatty", "expected"),
    [
        ({"TERM": "xterm-256color"}, True, None),
        ({"TERM": "xterm-kitty"}, True, "kitty"),
        ({"TERM": "xterm", "KITTY_WINDOW_ID": "1"}, True, "kitty"),
        ({"TERM": "xterm-kitty"}, False, None),  # piped: never escape codes
        ({"TERM": "xterm-kitty", "TMUX": "/tmp/tmux-1/default,1,0"}, True, None),
        ({"TERM_PROGRAM": "iTerm.app"}, True, "iterm2"),
        ({"LC_TERMINAL": "iTerm2", "TERM": "xterm-256color"}, True, "iterm2"),
        ({"TERM_PROGRAM": "WezTerm"}, True, "iterm2"),
        ({"TERM": "foot"}, True, "sixel"),
        ({"TERM": "screen-256color", "TERM_PROGRAM": "iTerm.app"}, True, None),
        ({"ROLL_INLINE_IMAGES": "sixel"}, False, "sixel"),  # forced, even when piped
        ({"ROLL_INLINE_IMAGES": "none", "TERM": "xterm-kitty"}, True, None),
    ],
)
def test_detection_is_conservative(environ: dict, isatty: bool, expected: str | None) -> None:
    assert detect_protocol(environ, isatty=isatty) == expected


def test_sixel_of_two_pixels_by_hand() -> None:
    image = Image.new("RGB", (2, 1))
    image.putpixel((0, 0), (255, 0, 0))
    image.putpixel((1, 0), (0, 0, 255))
    # raster 2x1; colour 0 red, 1 blue (percent); one band: red on column 0 ('@' = 63 + 1:
    # the band's top row), then '$' back to the band start, blue on column 1; '-' ends the band
    assert sixel(image) == '\x1bPq"1;1;2;1#0;2;100;0;0#1;2;0;0;100#0@?$#1?@-\x1b\\'
    # 5x7 of one colour: a full band ('~' = 63 + 0b111111) and a 1-row band, run-length coded
    green = Image.new("RGB", (5, 7), (0, 255, 0))
    assert sixel(green) == '\x1bPq"1;1;5;7#0;2;0;100;0#0!5~-#0!5@-\x1b\\'


def test_kitty_and_iterm2_carry_the_enlarged_png() -> None:
    image = Image.new("RGB", (28, 28), (10, 20, 30))  # enlarged x6 to 168 px
    seq = inline_image(image, "iterm2")
    assert seq.startswith("\x1b]1337;File=inline=1;size=") and seq.endswith("\a")
    png = base64.b64decode(seq[seq.index(":") + 1 : -1])
    shown = Image.open(io.BytesIO(png))
    assert shown.size == (168, 168) and shown.getpixel((100, 100)) == (10, 20, 30)

    noise = np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)
    noisy = Image.fromarray(noise)
    seq = inline_image(noisy, "kitty")  # a PNG over 4096 base64 bytes: several chunks
    chunks = seq.split("\x1b\\")[:-1]
    assert len(chunks) > 1 and chunks[0].startswith("\x1b_Ga=T,f=100,m=1;")
    assert all(c.startswith("\x1b_Gm=1;") for c in chunks[1:-1])
    assert chunks[-1].startswith("\x1b_Gm=0;")
    data = "".join(c.split(";", 1)[1] for c in chunks)
    assert Image.open(io.BytesIO(base64.b64decode(data))).size == (200, 200)
