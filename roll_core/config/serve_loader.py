"""Loading a `roll serve` recipe: the same YAML reading, overrides and readable errors as the
training pipelines' (loader.py), against :class:`~roll_core.config.serve.ServeConfig`."""

from __future__ import annotations

from pathlib import Path

from roll_core.config.loader import apply_overrides, read_yaml, validate
from roll_core.config.serve import ServeConfig
from roll_core.errors import ConfigError


def load_serve_recipe(path: str | Path, overrides: list[str]) -> ServeConfig:
    """Read, override and validate a `pipeline: serve` recipe."""
    data = apply_overrides(read_yaml(path), list(overrides))
    name = data.setdefault("pipeline", "serve")
    if name != "serve":
        raise ConfigError(
            f"{path}: this recipe is for `{name}`, not `serve`.",
            hint="`roll serve` takes a `pipeline: serve` recipe (see docs/serve.md).",
        )
    return validate(ServeConfig, data, source=str(path))
