"""The built-in byte-level tokenizer: vocabulary, round trip, chat template, save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from roll_core.models.tokenizer import (
    CHAT_TEMPLATE,
    build_tokenizer,
    bytes_to_unicode,
    padded_vocab_size,
    tokenizer_size,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_byte_alphabet_is_the_byte_level_alphabet() -> None:
    assert set(bytes_to_unicode().values()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_vocab_is_bytes_then_specials(tokenizer) -> None:
    # 256 byte tokens + <|endoftext|>, <|im_start|>, <|im_end|> = 259; rounded up to 64: 320.
    assert len(tokenizer) == tokenizer_size() == 259
    assert padded_vocab_size(len(tokenizer)) == 320
    assert padded_vocab_size(64) == 64
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        256,
        257,
        258,
    ]
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 256
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 258


def test_every_byte_is_one_token(tokenizer) -> None:
    assert tokenizer.encode("12+345=357") == list(b"12+345=357")
    assert tokenizer.encode("é") == list("é".encode())  # two UTF-8 bytes, two tokens


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "  two  spaces,\ttab\nnewline ",
        "12345 + 678 = 7023",
        "é漢",
        "naïve café, 漢字, emoji 🙂",
        "<|im_start|>user\nhi<|im_end|>\n",
        "",
    ],
)
def test_decode_round_trips(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_build_is_deterministic() -> None:
    assert (
        build_tokenizer().backend_tokenizer.to_str() == build_tokenizer().backend_tokenizer.to_str()
    )


def test_chat_template_renders_exactly(tiny_dir: Path) -> None:
    loaded = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    prompt = loaded.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_saved_tokenizer_loads_as_the_same_tokenizer(tiny_dir: Path, tokenizer) -> None:
    loaded = AutoTokenizer.from_pretrained(tiny_dir)
    text = "<|im_start|>user\n12+3 é漢<|im_end|>\n"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.pad_token_id, loaded.eos_token_id) == (256, 258)
    assert loaded.model_max_length == 512  # tiny-qwen3's max_position_embeddings
