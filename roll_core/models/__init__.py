"""Models and tokenizers: built-in tiny Qwen3 models, local directories and hub ids.

``builtin:NAME`` names a built-in model (see :data:`BUILTIN_MODELS`); :func:`load_causal_lm`
and :func:`load_tokenizer` accept it, a local Hugging Face model directory or a hub id.
"""

from roll_core.models.builtin import (
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    BuiltinSpec,
    builtin_dir,
    default_cache_dir,
    get_builtin,
    materialize_builtin,
)
from roll_core.models.loading import (
    chat_template_status,
    check_chat_template_choice,
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    model_summary,
    resolve_model_path,
    resolve_tokenizer_path,
    use_chat_template,
)
from roll_core.models.tokenizer import CHAT_TEMPLATE, build_tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_PREFIX",
    "CHAT_TEMPLATE",
    "BuiltinSpec",
    "build_tokenizer",
    "builtin_dir",
    "chat_template_status",
    "check_chat_template_choice",
    "count_parameters",
    "default_cache_dir",
    "get_builtin",
    "load_causal_lm",
    "load_tokenizer",
    "materialize_builtin",
    "model_summary",
    "resolve_model_path",
    "resolve_tokenizer_path",
    "use_chat_template",
]
