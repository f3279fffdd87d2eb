"""Pictures in the terminal: the kitty, iTerm2 and sixel image protocols, detected conservatively.

``roll debug-env`` saves every image observation as a PNG and prints its path; where the
terminal is known to draw images it also shows the picture inline. Detection only trusts what
the terminal itself sets (a terminal that cannot draw would print the escape codes as
garbage): ``KITTY_WINDOW_ID`` or ``TERM=xterm-kitty`` (kitty; Ghostty sets
``TERM=xterm-ghostty`` and speaks kitty's protocol), ``TERM_PROGRAM`` / ``LC_TERMINAL`` of
iTerm2 or WezTerm (iTerm2's protocol), a ``TERM`` of foot, mlterm or yaft (sixel), and never
when stdout is not a terminal or inside tmux/screen (which do not pass images through).
``ROLL_INLINE_IMAGES=kitty|iterm2|sixel|none`` overrides the detection.

Small pictures are enlarged (nearest neighbour, whole multiples) to about ``MIN_SIDE`` pixels
so a 6x6 grid is not a speck; the saved file keeps the size the model sees.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL.Image import Image

PROTOCOLS = ("kitty", "iterm2", "sixel")
MIN_SIDE = 168
_KITTY_CHUNK = 4096


def detect_protocol(environ: Mapping[str, str], *, isatty: bool) -> str | None:
    """The image protocol of the terminal described by ``environ``, or None (print paths only)."""
    forced = environ.get("ROLL_INLINE_IMAGES", "").strip().lower()
    if forced:
        return forced if forced in PROTOCOLS else None
    if not isatty or environ.get("TMUX") or environ.get("TERM", "").startswith("screen"):
        return None
    term = environ.get("TERM", "")
    program = environ.get("TERM_PROGRAM", "")
    if environ.get("KITTY_WINDOW_ID") or term in ("xterm-kitty", "xterm-ghostty"):
        return "kitty"
    if program in ("iTerm.app", "WezTerm") or environ.get("LC_TERMINAL") == "iTerm2":
        return "iterm2"
    if term.startswith(("foot", "mlterm", "yaft")):
        return "sixel"
    return None


def inline_image(image: Image, protocol: str) -> str:
    """The escape sequence that draws ``image`` at the cursor with ``protocol``."""
    image = _enlarged(image.convert("RGB"))
    if protocol == "sixel":
        return sixel(image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    data = base64.standard_b64encode(buf.getvalue()).decode("ascii")
    if protocol == "iterm2":
        return f"\x1b]1337;File=inline=1;size={len(buf.getvalue())};preserveAspectRatio=1:{data}\a"
    if protocol == "kitty":  # PNG (f=100), transmit and show (a=T), base64 in 4096-byte chunks
        chunks = [data[i : i + _KITTY_CHUNK] for i in range(0, len(data), _KITTY_CHUNK)] or [""]
        parts = []
        for i, chunk in enumerate(chunks):
            more = int(i < len(chunks) - 1)
            head = f"a=T,f=100,m={more}" if i == 0 else f"m={more}"
            parts.append(f"\x1b_G{head};{chunk}\x1b\\")
        return "".join(parts)
    raise ValueError(f"unknown image protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")


def sixel(image: Image) -> str:
    """``image`` as DEC sixel graphics: a palette of at most 256 colours, bands of 6 rows."""
    from PIL import Image as PILImage

    paletted = image.convert("RGB").quantize(colors=256, dither=PILImage.Dither.NONE)
    width, height = paletted.size
    raw = paletted.getpalette() or []
    pixels = list(paletted.getdata())
    used = sorted(set(pixels))
    out = ['\x1bPq"1;1;', f"{width};{height}"]
    for index in used:
        r, g, b = raw[3 * index : 3 * index + 3]
        out.append(f"#{index};2;{r * 100 // 255};{g * 100 // 255};{b * 100 // 255}")
    for top in range(0, height, 6):
        rows = range(top, min(top + 6, height))
        colours = sorted({pixels[y * width + x] for y in rows for x in range(width)})
        for k, index in enumerate(colours):
            bits = []
            for x in range(width):
                v = sum(1 << (y - top) for y in rows if pixels[y * width + x] == index)
                bits.append(chr(63 + v))
            out.append(f"#{index}{_run_length(''.join(bits))}")
            out.append("$" if k < len(colours) - 1 else "-")
    out.append("\x1b\\")
    return "".join(out)


def _run_length(line: str) -> str:
    """Sixel run-length compression: ``!N?`` for N repeats of ``?`` (runs of 4 or more)."""
    out, i = [], 0
    while i < len(line):
        j = i
        while j < len(line) and line[j] == line[i]:
            j += 1
        n = j - i
        out.append(f"!{n}{line[i]}" if n >= 4 else line[i] * n)
        i = j
    return "".join(out)


def _enlarged(image: Image) -> Image:
    from PIL import Image as PILImage

    factor = max(1, MIN_SIDE // max(image.size))
    if factor == 1:
        return image
    return image.resize((image.width * factor, image.height * factor), PILImage.Resampling.NEAREST)


def terminal_protocol() -> str | None:
    """:func:`detect_protocol` for this process's environment and stdout."""
    import sys

    return detect_protocol(os.environ, isatty=sys.stdout.isatty())
