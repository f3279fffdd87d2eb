"""Data: the Batch type, chat-template rendering, dataset sources, SFT tokenisation and masks, the resumable loader,
the prompts of `roll train rlvr` (prompts.py), the tiny arithmetic and image data sets, and the per-sample vision inputs of VLMs (vision.py).

Nothing here imports ``roll_core.engine``, Ray or the CLI; everything runs on CPU in tests.

Imports are lazy (PEP 562): ``from roll_core.data import Batch`` loads only what it names, so a
worker process that needs the Batch type does not import the dataset libraries (``datasets``,
pandas: about a second per process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roll_core.data.arith import (
        PROMPT_TEMPLATE,
        arith_row,
        make_arith_rows,
        write_arith_dataset,
    )
    from roll_core.data.batch import Batch
    from roll_core.data.chat import (
        encode_chat,
        encode_chat_images,
        image_message,
        prompt_turns,
        render_chat,
    )
    from roll_core.data.loader import StatefulLoader
    from roll_core.data.prompts import (
        Prompt,
        PromptStream,
        encode_text_prompt,
        load_prompts,
        prompts_note,
    )
    from roll_core.data.sft import (
        build_sft_dataset,
        collate_sft,
        encode_chat_prompt,
        encode_messages,
        encode_prompt,
        encode_prompt_response,
    )
    from roll_core.data.sources import (
        BUILDERS,
        is_local_path,
        load_rows,
        require_columns,
        require_field,
        row_value,
    )
    from roll_core.data.vision import VisionInputs, read_images

_LAZY = {
    "PROMPT_TEMPLATE": "roll_core.data.arith",
    "arith_row": "roll_core.data.arith",
    "make_arith_rows": "roll_core.data.arith",
    "write_arith_dataset": "roll_core.data.arith",
    "Batch": "roll_core.data.batch",
    "encode_chat": "roll_core.data.chat",
    "encode_chat_images": "roll_core.data.chat",
    "image_message": "roll_core.data.chat",
    "prompt_turns": "roll_core.data.chat",
    "render_chat": "roll_core.data.chat",
    "StatefulLoader": "roll_core.data.loader",
    "Prompt": "roll_core.data.prompts",
    "PromptStream": "roll_core.data.prompts",
    "encode_text_prompt": "roll_core.data.prompts",
    "load_prompts": "roll_core.data.prompts",
    "prompts_note": "roll_core.data.prompts",
    "build_sft_dataset": "roll_core.data.sft",
    "collate_sft": "roll_core.data.sft",
    "encode_chat_prompt": "roll_core.data.sft",
    "encode_messages": "roll_core.data.sft",
    "encode_prompt": "roll_core.data.sft",
    "encode_prompt_response": "roll_core.data.sft",
    "BUILDERS": "roll_core.data.sources",
    "is_local_path": "roll_core.data.sources",
    "load_rows": "roll_core.data.sources",
    "require_columns": "roll_core.data.sources",
    "require_field": "roll_core.data.sources",
    "row_value": "roll_core.data.sources",
    "VisionInputs": "roll_core.data.vision",
    "read_images": "roll_core.data.vision",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BUILDERS",
    "PROMPT_TEMPLATE",
    "Batch",
    "Prompt",
    "PromptStream",
    "VisionInputs",
    "StatefulLoader",
    "arith_row",
    "build_sft_dataset",
    "collate_sft",
    "encode_chat",
    "encode_chat_images",
    "encode_chat_prompt",
    "encode_messages",
    "encode_prompt",
    "encode_prompt_response",
    "encode_text_prompt",
    "image_message",
    "is_local_path",
    "load_prompts",
    "load_rows",
    "make_arith_rows",
    "prompt_turns",
    "prompts_note",
    "read_images",
    "render_chat",
    "require_columns",
    "require_field",
    "row_value",
    "write_arith_dataset",
]
