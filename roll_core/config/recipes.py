"""The one map from a recipe's `pipeline:` name to its schema."""

from __future__ import annotations

from roll_core.config.agentic import AgenticConfig
from roll_core.config.preference import DistillConfig, DPOConfig
from roll_core.config.rlvr import RLVRConfig
from roll_core.config.schema import RunConfig, SFTConfig

Recipe = SFTConfig | DPOConfig | DistillConfig | RLVRConfig | AgenticConfig
"""A validated recipe of any pipeline (what `load_recipe` returns)."""

RLRecipe = RLVRConfig | AgenticConfig
"""A validated recipe of an RL pipeline."""

PIPELINES: dict[str, type[RunConfig]] = {
    "sft": SFTConfig,
    "dpo": DPOConfig,
    "distill": DistillConfig,
    "rlvr": RLVRConfig,
    "agentic": AgenticConfig,
}
"""Recipe schema per pipeline name (the recipe's `pipeline:` key), in the order of
`docs/config.md`."""
