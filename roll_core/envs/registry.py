"""Env registry: built-in envs by name, user envs by dotted path, options validated per env.

``get_env_class("sokoban")`` looks a name up; ``get_env_class("my_pkg.envs:Maze")`` imports
``my_pkg.envs`` (from the installed packages or the current directory) and takes its ``Maze``,
which must subclass :class:`~roll_core.envs.base.TextEnv`; ``gem:ID`` is the env ``ID`` of the
GEM package (:mod:`roll_core.envs.gem_adapter`). Options are keyword arguments
validated by the env's pydantic ``Options`` model, so a typo or a wrong type is a
:class:`~roll_core.errors.ConfigError` that names the option and lists the valid ones.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

import yaml

from roll_core.envs.base import _REGISTRY, TextEnv
from roll_core.envs.base import describe_options as describe_options
from roll_core.envs.base import env_id as env_id
from roll_core.envs.base import validate_options as validate_options
from roll_core.errors import ConfigError

E = TypeVar("E", bound=type[TextEnv])


def register_env(cls: E) -> E:
    """Class decorator: register a :class:`TextEnv` subclass under its ``name``."""
    if not (inspect.isclass(cls) and issubclass(cls, TextEnv)) or not cls.name:
        raise TypeError("register_env takes a TextEnv subclass with a non-empty `name`")
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(f"env name {cls.name!r} is taken by {other.__module__}.{other.__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def registered_envs() -> dict[str, type[TextEnv]]:
    """The registered envs by name, sorted."""
    return dict(sorted(_REGISTRY.items()))


def get_env_class(name: str) -> type[TextEnv]:
    """The env class for a registered ``name``, a ``gem:ID`` GEM env or a
    ``package.module:Class`` path."""
    if name.strip().startswith("gem:"):
        from roll_core.envs.gem_adapter import gem_env_class

        return gem_env_class(name.strip())
    if ":" in name:
        return _import_env(name)
    key = name.strip().lower().replace("-", "_")
    if key in _REGISTRY:
        return _REGISTRY[key]
    valid = list(registered_envs())
    close = difflib.get_close_matches(key, valid, n=1)
    suggestion = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"unknown env '{name}'.{suggestion} Registered envs: {', '.join(valid)}.",
        hint="Use a registered name, a GEM env as gem:ID (e.g. gem:game:GuessTheNumber-v0-easy), "
        "or a user env as a dotted path package.module:Class "
        "(a TextEnv subclass, importable from the installed packages or the current directory).",
    )


def make_env(name: str, **options: Any) -> TextEnv:
    """Build the env ``name`` (registered or dotted path) with keyword ``options``."""
    return get_env_class(name)(**options)


def parse_option_args(args: Iterable[str]) -> dict[str, Any]:
    """``["size=6", "is_slippery=true"]`` -> ``{"size": 6, "is_slippery": True}``.

    Values are parsed as YAML, except text that spans lines or starts with ``#`` (a grid such
    as a Sokoban room), which stays a string.
    """
    options: dict[str, Any] = {}
    for item in args:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(
                f"env option {item!r} is not of the form name=value.",
                hint="Example: `roll debug-env sokoban width=7 num_boxes=2`.",
            )
        if key in options:
            raise ConfigError(f"env option '{key}' is given twice.")
        if "\n" in raw or raw.lstrip().startswith("#"):
            options[key] = raw  # a grid: YAML would fold its lines or read `#` as a comment
            continue
        try:
            options[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            options[key] = raw
    return options


def _import_env(path: str) -> type[TextEnv]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(
            f"env path '{path}' is not of the form package.module:Class.",
            hint="Example: my_envs.maze:MazeEnv, where my_envs/maze.py defines class MazeEnv.",
        )
    module = _import_module(module_name, path)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            found = [n for n, v in vars(module).items() if _is_env_class(v, TextEnv)]
            listing = ", ".join(sorted(found)) or "none"
            raise ConfigError(
                f"module '{module_name}' has no '{attr}' (env path '{path}').",
                hint=f"TextEnv subclasses in {module_name}: {listing}.",
            )
    if not _is_env_class(obj, TextEnv):
        raise ConfigError(
            f"'{path}' is not a TextEnv subclass (it is {type(obj).__name__} {obj!r}).",
            hint="A user env subclasses roll_core.envs.TextEnv (see docs/envs.md); wrap a "
            "gymnasium env with roll_core.envs.gym_adapter.GymnasiumTextEnv.",
        )
    return obj  # type: ignore[no-any-return]


def _is_env_class(obj: Any, base: type) -> bool:
    return inspect.isclass(obj) and issubclass(obj, base) and not inspect.isabstract(obj)


def _import_module(module_name: str, path: str, what: str = "env") -> Any:
    cwd = os.getcwd()
    try:
        if cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)  # like `python -m`: a module in the current directory imports
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"cannot import module '{module_name}' for {what} '{path}': {err}.",
            hint="Install the package that holds it, or run from the directory that holds "
            "the module (the current directory is searched).",
        ) from None
    except Exception as err:  # a user module that fails while importing: the user's to fix
        raise ConfigError(
            f"importing module '{module_name}' for {what} '{path}' raised "
            f"{type(err).__name__}: {err}.",
            hint="Fix the module (rerun with --debug for the traceback).",
        ) from err
