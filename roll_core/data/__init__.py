"""Data: the Batch type, chat-template rendering, dataset sources, SFT tokenisation and masks, the resumable loader,
and the tiny arithmetic data set.

Nothing here imports ``roll_core.engine``, Ray or the CLI; everything runs on CPU in tests.
"""

from roll_core.data.arith import PROMPT_TEMPLATE, arith_row, make_arith_rows, write_arith_dataset
from roll_core.data.batch import Batch
from roll_core.data.chat import encode_chat, render_chat
from roll_core.data.loader import StatefulLoader
from roll_core.data.sft import (
    build_sft_dataset,
    collate_sft,
    encode_chat_prompt,
    encode_messages,
    encode_prompt,
    encode_prompt_response,
)
from roll_core.data.sources import BUILDERS, is_local_path, load_rows, require_columns

__all__ = [
    "BUILDERS",
    "PROMPT_TEMPLATE",
    "Batch",
    "StatefulLoader",
    "arith_row",
    "build_sft_dataset",
    "collate_sft",
    "encode_chat",
    "encode_chat_prompt",
    "encode_messages",
    "encode_prompt",
    "encode_prompt_response",
    "is_local_path",
    "load_rows",
    "make_arith_rows",
    "render_chat",
    "require_columns",
    "write_arith_dataset",
]
