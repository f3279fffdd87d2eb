"""The tokenizer of the built-in tiny models, built in code and identical on every call.

It is a byte-level BPE with the 256 byte symbols as its whole base vocabulary and no merges:
every byte is one token (token id == byte value), so every ASCII character, and in particular
every digit, is a single token, and any text round-trips through encode/decode. Three special
tokens follow the bytes: ``<|endoftext|>`` (padding), ``<|im_start|>`` and ``<|im_end|>``
(end of a chat turn, the eos token). The chat template is Qwen's ChatML without a default
system message.

The result is a ``transformers.PreTrainedTokenizerFast`` saved with ``save_pretrained``, so it
loads through ``AutoTokenizer.from_pretrained`` like any hub tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
EOS_TOKEN = IM_END_TOKEN
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
NUM_BYTE_TOKENS = 256
VOCAB_MULTIPLE = 64

# Renders `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then, with
# add_generation_prompt, `<|im_start|>assistant\n`.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# The class name written to tokenizer_config.json: understood by transformers 4.x and 5.x alike.
_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the byte-level BPE alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in mapping:
            mapping[b] = chr(NUM_BYTE_TOKENS + shift)
            shift += 1
    return mapping


def tokenizer_size() -> int:
    """``len(tokenizer)`` of the built-in tokenizer, known without building it."""
    return NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)


def padded_vocab_size(num_tokens: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``num_tokens`` rounded up to a multiple of ``multiple`` (the model's embedding rows)."""
    return -(-num_tokens // multiple) * multiple


def _byte_level_tokenizer() -> Tokenizer:
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(NUM_BYTE_TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def build_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """Build the built-in byte-level tokenizer (in memory; nothing is written)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_tokenizer(),
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """Save with ``save_pretrained``, naming a tokenizer class every transformers version knows."""
    tokenizer.save_pretrained(directory)
    config_file = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["tokenizer_class"] = _TOKENIZER_CLASS
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    config_file.write_text(text, encoding="utf-8")
