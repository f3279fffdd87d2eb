"""Recipes: typed schema, YAML loading, overrides and readable validation errors."""

from roll_core.config.loader import apply_overrides, dump_config, load_recipe, read_yaml, validate
from roll_core.config.schema import PIPELINES, SFTConfig

__all__ = [
    "PIPELINES",
    "SFTConfig",
    "apply_overrides",
    "dump_config",
    "load_recipe",
    "read_yaml",
    "validate",
]
