"""Image observations of the grid games (obs_mode=image): hand-checked pixels, the protocol."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from roll_core.envs import make_env
from roll_core.envs.base import Observation, observation_images
from roll_core.envs.frozen_lake import PALETTE as LAKE
from roll_core.envs.grid import grid_image
from roll_core.envs.sokoban import PALETTE as SOKO
from roll_core.errors import ConfigError


def _px(image, row: int, col: int) -> tuple[int, int, int]:
    """Pixel at (row, col) of an image (PIL's getpixel takes (x, y))."""
    return tuple(image.getpixel((col, row)))


def test_grid_image_fills_cells_and_draws_things_as_centred_squares() -> None:
    palette = {"a": (1, 2, 3), "b": (200, 100, 0), "x": (9, 9, 9)}
    # 2 rows x 3 columns of 4 px cells: 8 x 12 pixels; a thing at (1, 2) covers rows 5-6,
    # columns 9-10 (border 4 // 4 = 1 px of floor colour)
    img = grid_image([["a", "b", "a"], ["b", "a", "a"]], {(1, 2): "x"}, palette, 4)
    assert img.mode == "RGB" and img.size == (12, 8)
    pixels = np.asarray(img)
    assert (pixels[0:4, 0:4] == (1, 2, 3)).all()
    assert (pixels[0:4, 4:8] == (200, 100, 0)).all()
    assert (pixels[4:8, 0:4] == (200, 100, 0)).all()
    cell = pixels[4:8, 8:12].copy()  # the cell (1, 2) with the thing on it
    assert (cell[1:3, 1:3] == (9, 9, 9)).all()
    cell[1:3, 1:3] = (1, 2, 3)
    assert (cell == (1, 2, 3)).all()  # a 1 px border of floor colour around it


def test_frozen_lake_picture_pixels() -> None:
    env = make_env("frozen_lake", map="SH/FG", obs_mode="image", cell_px=4)
    obs, _ = env.reset(0)
    assert isinstance(obs, Observation)
    (img,) = obs.images
    assert img.size == (8, 8)
    # player on the start cell (0, 0): centre red, border white
    assert _px(img, 1, 1) == _px(img, 2, 2) == LAKE["P"] == (220, 40, 40)
    assert _px(img, 0, 0) == _px(img, 3, 3) == LAKE["S"] == (250, 250, 250)
    assert _px(img, 0, 4) == _px(img, 2, 6) == LAKE["H"] == (20, 40, 110)
    assert _px(img, 4, 0) == _px(img, 6, 2) == LAKE["F"] == (170, 215, 245)
    assert _px(img, 7, 7) == _px(img, 5, 5) == LAKE["G"] == (240, 190, 0)
    obs, reward, terminated, _, _ = env.step("Down")
    (img,) = observation_images(obs)
    assert _px(img, 1, 1) == LAKE["S"]  # the player left the start
    assert _px(img, 5, 1) == LAKE["P"] and _px(img, 4, 0) == LAKE["F"]
    assert (reward, terminated) == (0.0, False)
    assert obs == "You moved Down.\nThe picture shows the lake. Legal moves: Up, Down, Left, Right."


def test_sokoban_picture_pixels_show_a_box_on_a_target() -> None:
    env = make_env("sokoban", room="#####/#@$.#/#####", obs_mode="image")  # 5 x 3 cells of 14 px
    obs, _ = env.reset(0)
    (img,) = obs.images
    assert img.size == (70, 42)
    centre, corner = 7, 0  # offsets inside a cell; the square is rows/cols 3..10
    assert _px(img, 0 + centre, 0 + centre) == SOKO["wall"]
    assert _px(img, 14 + centre, 14 + centre) == SOKO["player"] == (40, 80, 220)
    assert _px(img, 14 + corner, 14 + corner) == SOKO["floor"]
    assert _px(img, 14 + 3, 28 + 3) == SOKO["box"] and _px(img, 14 + 2, 28 + 2) == SOKO["floor"]
    assert _px(img, 14 + centre, 42 + centre) == SOKO["target"]
    obs, reward, terminated, _, info = env.step("Right")
    assert terminated and info["success"]
    (img,) = obs.images
    assert _px(img, 14 + centre, 42 + centre) == SOKO["box"]  # the box stands on the target
    assert _px(img, 14 + corner, 42 + corner) == SOKO["target"]
    assert _px(img, 14 + centre, 28 + centre) == SOKO["player"]
    assert _px(img, 14 + centre, 14 + centre) == SOKO["floor"]
    assert obs.startswith("You pushed a box Right. It is on a target.")
    assert "#" not in obs.text  # no text grid in image mode
    assert "picture" in env.system_prompt and "Symbols" not in env.system_prompt


def test_invalid_actions_keep_the_picture() -> None:
    env = make_env("frozen_lake", map="SF/FG", obs_mode="image")
    env.reset(0)
    obs, reward, *_ = env.step("jump")
    assert len(observation_images(obs)) == 1 and reward == -0.1
    assert obs.startswith("Invalid action: 'jump' is not one of Up, Down, Left, Right.")
    assert obs.endswith("Legal moves: Up, Down, Left, Right.")


def test_text_mode_is_unchanged_and_has_no_images() -> None:
    for env in (make_env("sokoban"), make_env("frozen_lake", map="SF/FG")):
        obs, _ = env.reset(3)
        assert type(obs) is str and observation_images(obs) == ()
        assert env.render_image() is None
        result = env.step("Up")
        assert type(result.observation) is str
    assert make_env("frozen_lake", map="SF/FG").reset(0)[0] == "PF\nFG"


def test_pictures_are_deterministic_and_pickle_with_their_observation() -> None:
    a = make_env("sokoban", obs_mode="image").reset(11)[0]
    b = make_env("sokoban", obs_mode="image").reset(11)[0]
    assert a.images[0].tobytes() == b.images[0].tobytes() and a.images[0].size == (84, 84)
    back = pickle.loads(pickle.dumps(a))
    assert isinstance(back, Observation) and back == a and type(back.text) is str
    assert back.images[0].tobytes() == a.images[0].tobytes()
    assert type(a + "!") is str  # string operations drop the pictures


def test_bad_obs_mode_is_named() -> None:
    with pytest.raises(ConfigError, match="obs_mode"):
        make_env("frozen_lake", obs_mode="video")
    with pytest.raises(ConfigError, match="cell_px"):
        make_env("sokoban", obs_mode="image", cell_px=1)
