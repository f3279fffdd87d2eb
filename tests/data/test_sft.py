"""Tests for roll_core/data/sft.py on the built-in byte-level tokenizer.

That tokenizer maps every byte to the token of the same id and has three special tokens:
256 ``<|endoftext|>`` (pad), 257 ``<|im_start|>``, 258 ``<|im_end|>``. So expected ids and
masks can be written down by hand from the rendered text.
"""

from __future__ import annotations

import copy

import datasets
import pytest
import torch

from roll_core.data import (
    build_sft_dataset,
    collate_sft,
    encode_messages,
    encode_prompt,
    encode_prompt_response,
)
from roll_core.errors import DataError

PAD, START, END = 256, 257, 258


def b(text: str) -> list[int]:
    return list(text.encode())


def turn(role: str, content: str) -> list[int]:
    return [START, *b(f"{role}\n{content}"), END, *b("\n")]


def test_special_token_ids(tokenizer) -> None:
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        PAD,
        START,
        END,
    ]


def test_prompt_response_ids_and_mask(tokenizer) -> None:
    ex = encode_prompt_response(tokenizer, "What is 2 + 3?", "5")
    header = [START, *b("assistant\n")]
    prompt = turn("user", "What is 2 + 3?") + header  # 1+19+1+1 + 11 = 33 tokens
    assert len(prompt) == 33
    assert ex["input_ids"] == [*prompt, ord("5"), END, ord("\n")]
    # "5" and <|im_end|> are trained; the "\n" after <|im_end|> is not
    assert ex["loss_mask"] == [0] * 33 + [1, 1, 0]
    assert encode_prompt(tokenizer, "What is 2 + 3?") == prompt


@pytest.mark.parametrize("response", ["68", "a longer answer.", "é\n"])
def test_mask_sum_is_response_bytes_plus_end(tokenizer, response: str) -> None:
    ex = encode_prompt_response(tokenizer, "q", response, system="Be brief.")
    assert sum(ex["loss_mask"]) == len(response.encode()) + 1  # "é" is 2 bytes
    trained = [t for t, m in zip(ex["input_ids"], ex["loss_mask"], strict=True) if m]
    assert trained == [*b(response), END]
    assert ex["input_ids"][: len(turn("system", "Be brief."))] == turn("system", "Be brief.")


def test_messages_train_every_assistant_turn(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a22"},
    ]
    ex = encode_messages(tokenizer, messages)
    expected_ids = sum((turn(m["role"], m["content"]) for m in messages), [])
    assert ex["input_ids"] == expected_ids
    mask = []
    for m in messages:
        n = len(turn(m["role"], m["content"]))
        if m["role"] == "assistant":  # header "<|im_start|>assistant\n" = 11 tokens, then
            k = len(m["content"].encode()) + 1  # content + <|im_end|> trained, "\n" not
            mask += [0] * 11 + [1] * k + [0]
            assert n == 11 + k + 1
        else:
            mask += [0] * n
    assert ex["loss_mask"] == mask
    assert sum(mask) == 3 + 4


def test_template_that_is_not_prefix_stable(tokenizer) -> None:
    tok = copy.deepcopy(tokenizer)
    # marks the last message with "!": the prompt rendering is not a prefix of the full one
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% if loop.last %}!{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(DataError, match="prefix"):
        encode_prompt_response(tok, "hi", "5")
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        encode_prompt_response(tok, "hi", "5")


def test_build_counts_and_drops(tokenizer) -> None:
    rows = datasets.Dataset.from_list(
        [
            {"prompt": "What is 2 + 3?", "response": "5"},  # 36 tokens
            {"prompt": "What is 2 + 3?", "response": " "},  # blank response
            {"prompt": "What is 2 + 3?", "response": "55"},  # 37 tokens
        ]
    )
    examples, stats = build_sft_dataset(rows, tokenizer, fmt="prompt_response", max_length=36)
    assert stats == {
        "rows": 3,
        "kept": 1,
        "dropped_bad_image": 0,
        "dropped_too_long": 1,
        "dropped_empty": 1,
        "longest": 37,
    }
    assert examples == [encode_prompt_response(tokenizer, "What is 2 + 3?", "5")]


def test_build_everything_too_long(tokenizer) -> None:
    rows = datasets.Dataset.from_list([{"prompt": "What is 2 + 3?", "response": "5"}])
    with pytest.raises(DataError, match=r"data\.max_length=20.*\n.*at least 36"):
        build_sft_dataset(rows, tokenizer, fmt="prompt_response", max_length=20)


def test_build_missing_column(tokenizer) -> None:
    rows = datasets.Dataset.from_list([{"question": "q", "response": "r"}])
    with pytest.raises(DataError, match=r"no column 'prompt'; its columns are 'question'"):
        build_sft_dataset(rows, tokenizer, fmt="prompt_response", max_length=64)
    examples, _ = build_sft_dataset(
        rows, tokenizer, fmt="prompt_response", prompt_key="question", max_length=64
    )
    assert len(examples) == 1


def test_build_numbers_and_messages(tokenizer) -> None:
    rows = datasets.Dataset.from_list([{"prompt": "What is 2 + 3?", "response": 5}])
    (example,), _ = build_sft_dataset(rows, tokenizer, fmt="prompt_response", max_length=64)
    assert example == encode_prompt_response(tokenizer, "What is 2 + 3?", "5")

    chats = datasets.Dataset.from_list(
        [
            {"chat": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
            {"chat": [{"role": "user", "content": "only a question"}]},
        ]
    )
    examples, stats = build_sft_dataset(
        chats, tokenizer, fmt="messages", messages_key="chat", max_length=64
    )
    assert stats["kept"] == 1 and stats["dropped_empty"] == 1
    assert sum(examples[0]["loss_mask"]) == 2


def test_collate_right_pads() -> None:
    examples = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": [8], "loss_mask": [1]},
    ]
    batch = collate_sft(examples, pad_id=PAD)
    assert batch.keys() == ["input_ids", "attention_mask", "loss_mask"]
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.tensors.values())
    with pytest.raises(ValueError, match="Example 0"):
        collate_sft([{"input_ids": [1, 2], "loss_mask": [1]}], pad_id=PAD)


def test_tokenize_text_equals_the_tokenizer_call_and_respects_a_truncating_backend(
    tokenizer,
) -> None:
    from roll_core.data.sft import tokenize_text

    text = "<|im_start|>user\nhé 😀<|im_end|>\n"
    expected = [START, *b("user\nhé 😀"), END, *b("\n")]
    assert tokenize_text(tokenizer, text) == expected  # the backend, asked directly
    assert list(tokenizer(text, add_special_tokens=False)["input_ids"]) == expected
    truncating = copy.deepcopy(tokenizer)
    truncating._tokenizer.enable_truncation(max_length=3)  # tokenizer.json may set it
    # the direct path would truncate to 3; the tokenizer's own call does not
    assert tokenize_text(truncating, text) == expected
