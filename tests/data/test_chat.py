"""Tests for roll_core/data/chat.py on the built-in byte-level tokenizer (ChatML template).

Token ids: every byte is the token of the same id; 257 ``<|im_start|>``, 258 ``<|im_end|>``.
"""

from __future__ import annotations

import copy

import pytest

from roll_core.data import encode_chat, render_chat

START, END = 257, 258
SYS_HI = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
# a template that refuses a system message, as Gemma's does
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('no system role') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_render_chatml(tokenizer) -> None:
    assert render_chat(tokenizer, SYS_HI, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(tokenizer, SYS_HI[1:], add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_encode_returns_plain_ids(tokenizer) -> None:
    ids = encode_chat(tokenizer, SYS_HI[1:], add_generation_prompt=True)
    # <|im_start|> "user\nhi" <|im_end|> "\n" <|im_start|> "assistant\n": 1+7+1+1+1+10 = 21 ids
    expected = [START, *b"user\nhi", END, *b"\n", START, *b"assistant\n"]
    assert ids == expected and len(ids) == 21
    assert all(type(i) is int for i in ids)
    # the same ids as tokenising the rendered text without extra special tokens
    text = render_chat(tokenizer, SYS_HI[1:], add_generation_prompt=True)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_fold_system_only_when_asked(tokenizer) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = NO_SYSTEM
    with pytest.raises(Exception, match="no system role"):
        render_chat(tok, SYS_HI, add_generation_prompt=True)
    folded = render_chat(tok, SYS_HI, add_generation_prompt=True, fold_system=True)
    assert folded == "<user>S\n\nhi<assistant>"
    assert encode_chat(tok, SYS_HI, add_generation_prompt=False, fold_system=True) == list(
        b"<user>S\n\nhi"
    )
    # nothing to fold into: the template's error is the caller's
    with pytest.raises(Exception, match="no system role"):
        render_chat(tok, SYS_HI[:1], add_generation_prompt=True, fold_system=True)


# -- prompt_turns: conversation cells of a dataset (issue 32, item 12) ------------------------


def test_prompt_turns_reads_a_conversation_and_drops_parquet_nulls() -> None:
    from roll_core.data import prompt_turns

    # parquet writes every key of the turns' struct into each turn: a None `name` is dropped
    cell = [{"role": "user", "content": "What is 2 + 3?", "name": None}]
    assert prompt_turns(cell, row=0, column="prompt", source="d.parquet") == [
        {"role": "user", "content": "What is 2 + 3?"}
    ]
    assert prompt_turns("What is 2 + 3?", row=0, column="prompt", source="d.parquet") is None
    assert prompt_turns(None, row=0, column="prompt", source="d.parquet") is None


@pytest.mark.parametrize(
    ("cell", "says"),
    [
        (["What is 2 + 3?"], "Row 7 of column 'messages' in d.parquet is a list, but its item 0"),
        ([{"role": "human", "content": "hi"}], "turn 0 has role 'human'; the roles are system"),
        ([{"content": "hi"}], "turn 0 has role None"),
        ([{"role": "user", "content": ["a"]}], "turn 0 (user) has content of type list"),
        (
            [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}],
            "ends with an assistant turn",
        ),
    ],
)
def test_prompt_turns_refuses_bad_shapes_naming_row_and_column(cell: list, says: str) -> None:
    from roll_core.data import prompt_turns
    from roll_core.errors import DataError

    with pytest.raises(DataError) as err:
        prompt_turns(cell, row=7, column="messages", source="d.parquet")
    assert says in err.value.message
    assert "Row 7 of column 'messages' in d.parquet" in err.value.message
