"""Data: the Batch type, chat-template rendering, dataset sources, SFT tokenisation and masks, the resumable loader,
the prompts of `roll train rlvr` (prompts.py), the tiny arithmetic and image data sets, and the per-sample vision inputs of VLMs (vision.py).

Nothing here imports ``roll_core.engine``, Ray or the CLI; everything runs on CPU in tests.
"""

from roll_core.data.arith import PROMPT_TEMPLATE, arith_row, make_arith_rows, write_arith_dataset
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
