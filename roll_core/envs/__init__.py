"""Text environments behind one protocol (see :mod:`roll_core.envs.base` and docs/envs.md).

Built-in envs: ``sokoban``, ``frozen_lake``, ``tool_use``, ``swe`` (docs/swe.md). User envs are named by a dotted
path ``package.module:Class``. ``make_env(name, **options)`` builds either.
"""

from roll_core.envs.base import (
    EnvOptions,
    EnvStateError,
    InvalidAction,
    Observation,
    StepResult,
    TextEnv,
    Transition,
    extract_answer,
    observation_images,
    parse_choice,
)
from roll_core.envs.frozen_lake import FrozenLakeEnv
from roll_core.envs.registry import (
    describe_options,
    env_id,
    get_env_class,
    make_env,
    parse_option_args,
    register_env,
    registered_envs,
)
from roll_core.envs.sokoban import SokobanEnv
from roll_core.envs.swe import SweEnv
from roll_core.envs.tool_use import ToolUseEnv

__all__ = [
    "EnvOptions",
    "EnvStateError",
    "FrozenLakeEnv",
    "InvalidAction",
    "Observation",
    "SokobanEnv",
    "StepResult",
    "SweEnv",
    "TextEnv",
    "ToolUseEnv",
    "Transition",
    "describe_options",
    "env_id",
    "extract_answer",
    "get_env_class",
    "make_env",
    "observation_images",
    "parse_choice",
    "parse_option_args",
    "register_env",
    "registered_envs",
]
