"""Recipes: typed schema, YAML loading, overrides and readable validation errors."""

from roll_core.config.agentic import AgenticConfig
from roll_core.config.loader import apply_overrides, dump_config, load_recipe, read_yaml, validate
from roll_core.config.recipes import PIPELINES
from roll_core.config.rlvr import RLVRConfig
from roll_core.config.schema import SFTConfig

__all__ = [
    "PIPELINES",
    "AgenticConfig",
    "RLVRConfig",
    "SFTConfig",
    "apply_overrides",
    "dump_config",
    "load_recipe",
    "read_yaml",
    "validate",
]
