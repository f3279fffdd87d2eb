"""Wrap a gymnasium env with a discrete action space as a roll text env.

gymnasium is optional (``pip install 'roll[gym]'``); it is imported only when such an env is
reset. A subclass names the gymnasium id, the text of each discrete action and how an
observation reads as text; everything else (parsing, invalid actions, max steps, seeding) is
:class:`~roll_core.envs.base.TextEnv`'s. The example below is the whole adapter for
gymnasium's own FrozenLake, usable as ``roll debug-env roll_core.envs.gym_adapter:GymFrozenLake``::

    class GymFrozenLake(GymnasiumTextEnv):
        env_id = "FrozenLake-v1"
        action_names = ("Left", "Down", "Right", "Up")   # gymnasium's action order
        Options = GymFrozenLakeOptions                     # is_slippery, map_name

        def make_kwargs(self):
            return {"is_slippery": self.options.is_slippery, "map_name": self.options.map_name}

        def observation_text(self, obs):                   # obs: the player's cell index
            desc = [[c.decode() for c in row] for row in self.gym_env.unwrapped.desc]
            row, col = divmod(int(obs), len(desc[0]))
            desc[row][col] = "P"
            return "\\n".join("".join(r) for r in desc)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from roll_core.envs.base import EnvOptions, TextEnv, Transition, parse_choice
from roll_core.envs.grid import ARROW_KEYS
from roll_core.errors import ConfigError


class GymnasiumTextEnv(TextEnv):
    """A gymnasium env (``Discrete`` actions) behind the text protocol.

    Set ``env_id`` and ``action_names`` (the text of action 0, 1, ...); override
    :meth:`observation_text` and, if needed, :meth:`make_kwargs` and :meth:`is_success`.
    The gymnasium env is seeded from the episode seed, so a seed gives the same episode.
    """

    env_id: ClassVar[str] = ""
    action_names: ClassVar[Sequence[str]] = ()

    gym_env: Any = None
    _last_obs: Any = None

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._choices = _action_choices(type(self).__name__, self.action_names)

    def make_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``gymnasium.make`` (default: none)."""
        return {}

    def observation_text(self, observation: Any) -> str:
        """A gymnasium observation as text (default: ``str(observation)``)."""
        return str(observation)

    def is_success(self, reward: float, terminated: bool, info: dict[str, Any]) -> bool:
        """Whether the episode was won (default: gymnasium's ``info["is_success"]``)."""
        return bool(info.get("is_success", False))

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        if self.gym_env is None:
            self.gym_env = _gym_make(self.env_id, self.make_kwargs())
        obs, info = self.gym_env.reset(seed=int(rng.integers(2**31)))
        self._last_obs = obs
        return self.observation_text(obs), dict(info)

    def parse_action(self, text: str) -> int:
        return list(self.action_names).index(parse_choice(text, self._choices))

    def on_step(self, action: int) -> Transition:
        obs, reward, terminated, truncated, info = self.gym_env.step(action)
        self._last_obs = obs
        info = {**info, "action": self.action_names[action]}
        info["success"] = self.is_success(float(reward), bool(terminated), info)
        return Transition(
            self.observation_text(obs), float(reward), bool(terminated), info, bool(truncated)
        )

    def render(self) -> str:
        return self.observation_text(self._last_obs)

    def valid_actions(self) -> list[str]:
        return list(self.action_names)


def _action_choices(env: str, names: Sequence[str]) -> dict[str, str]:
    """``action_names`` as :func:`parse_choice` choices; a name that cannot parse is an error.

    Any non-empty name parses (spaces, digits, ``_``, ``-``), case-insensitively; two names
    that differ only in case or spacing could never be told apart, so they are refused.
    """
    choices: dict[str, str] = {}
    for name in names:
        key = " ".join(str(name).lower().split())
        if not isinstance(name, str) or not key:
            raise ConfigError(
                f"the env {env} has an empty or non-text action name {name!r} in "
                f"action_names {tuple(names)!r}, so that action could never be chosen.",
                hint="Give every gymnasium action a non-empty text name (this is the env "
                "author's fix, in the env's class).",
            )
        if key in choices:
            raise ConfigError(
                f"the env {env} has two action names that read the same, {choices[key]!r} "
                f"and {name!r} (names match case-insensitively, any spacing), so the model "
                "could never choose between them.",
                hint="Give each gymnasium action a distinct name in the env's action_names.",
            )
        choices[key] = name
    if not choices:
        raise ConfigError(
            f"the env {env} has no action_names, so no action could ever be chosen.",
            hint="Set action_names to the text of gymnasium action 0, 1, ... in the env's class.",
        )
    return choices


def _gym_make(env_id: str, kwargs: dict[str, Any]) -> Any:
    try:
        import gymnasium
    except ImportError:
        raise ConfigError(
            f"the env {env_id} needs gymnasium, which is not installed.",
            hint="Install it with `pip install 'roll[gym]'` (or `pip install gymnasium`).",
        ) from None
    try:
        return gymnasium.make(env_id, **kwargs)
    except gymnasium.error.Error as err:
        raise ConfigError(f"gymnasium cannot make {env_id!r}: {err}") from None


class GymFrozenLakeOptions(EnvOptions):
    """Options of the gymnasium FrozenLake example."""

    max_steps: int = Field(20, ge=1, description="Steps before the episode is truncated.")
    is_slippery: bool = Field(False, description="gymnasium's slippery ice.")
    map_name: Literal["4x4", "8x8"] = Field("4x4", description="gymnasium's built-in map.")


class GymFrozenLake(GymnasiumTextEnv):
    """gymnasium's ``FrozenLake-v1`` as a text env: the adapter example (see module docs)."""

    env_id = "FrozenLake-v1"
    action_names = ("Left", "Down", "Right", "Up")
    Options = GymFrozenLakeOptions
    options: GymFrozenLakeOptions
    key_actions = ARROW_KEYS
    instructions = (
        "Reach the goal G on the frozen lake without stepping into a hole H "
        "(S start, F ice, P you). Answer with one move: <answer>Left</answer>, Down, Right or Up."
    )

    def make_kwargs(self) -> dict[str, Any]:
        return {"is_slippery": self.options.is_slippery, "map_name": self.options.map_name}

    def observation_text(self, observation: Any) -> str:
        desc = [[c.decode() for c in row] for row in self.gym_env.unwrapped.desc]
        row, col = divmod(int(observation), len(desc[0]))
        desc[row][col] = "P"
        return "\n".join("".join(r) for r in desc)

    def is_success(self, reward: float, terminated: bool, info: dict[str, Any]) -> bool:
        return terminated and reward > 0
