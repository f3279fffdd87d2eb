"""tinker-cookbook's supervised basic recipe (``tinker_cookbook.recipes.sl_basic``: its
``build_config_blueprint`` and ``main``, which runs ``tinker_cookbook.supervised.train.main``,
all unchanged) against `roll serve`. Run by tests/serve/test_cookbook.py as
``python sl_tiny.py BASE_URL LOG_DIR``; the cookbook writes its metrics to
``LOG_DIR/metrics.jsonl``.

What is set on the recipe's blueprint, and why (nothing else):

- ``model_name``: ``Qwen/Qwen3-8B``, a name recipes/serve/tiny.yaml serves with the built-in
  tiny model (the cookbook knows the name, so ``sl_basic`` picks its renderer);
- ``renderer_name``: ``qwen3``;
- the dataset: the swap ``sl_basic`` documents, ``FromConversationFileBuilder`` on the
  cookbook's bundled ``example_data/conversations.jsonl`` (NoRobots is a hub dataset), with
  ``model_name_for_tokenizer`` the local directory of the tiny model's tokenizer, and a small
  ``max_length`` / ``batch_size``;
- ``max_steps``, ``learning_rate`` (the tiny model from scratch needs a larger step than a
  pretrained 9B one), ``log_path``, ``base_url``.

The training loop also loads the tokenizer of ``model_name`` (for bits per byte): the tiny
model's tokenizer is registered under the served name, as a user of a local model would.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.recipes import sl_basic
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import register_tokenizer

from roll_core.models import load_tokenizer
from roll_core.models.loading import resolve_tokenizer_path

MODEL = "Qwen/Qwen3-8B"
TINY = "builtin:tiny-qwen3"
CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


def main() -> None:
    base_url, log_dir = sys.argv[1], sys.argv[2]
    register_tokenizer(MODEL, lambda: load_tokenizer(TINY))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=resolve_tokenizer_path(TINY),
        renderer_name="qwen3",
        max_length=192,
        batch_size=8,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    dataset = FromConversationFileBuilder(common_config=common, file_path=str(CONVERSATIONS))
    blueprint = sl_basic.build_config_blueprint(MODEL).apply(
        {
            "renderer_name": "qwen3",
            "dataset_builder": dataset,
            "learning_rate": 1e-2,
            "max_steps": 10,
            "eval_every": 0,
            "log_path": log_dir,
            "base_url": base_url,
        }
    )
    sl_basic.main(blueprint.make())


if __name__ == "__main__":
    main()
