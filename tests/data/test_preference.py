"""Tests for roll_core/data/preference.py on the built-in byte-level tokenizer (token id ==
byte value; 256 pad, 257 <|im_start|>, 258 <|im_end|>)."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import pytest

from roll_core.data import encode_prompt_response
from roll_core.data.preference import (
    build_preference_dataset,
    collate_pairs,
    near_miss,
    prompt_ids,
    write_arith_pairs,
)
from roll_core.errors import DataError

ROOT = Path(__file__).resolve().parents[2]
END = 258


def rows(*items: dict) -> datasets.Dataset:
    return datasets.Dataset.from_list(list(items))


def test_pairs_encode_like_sft_and_identical_pairs_are_skipped(tokenizer) -> None:
    data = rows(
        {"prompt": "What is 1 + 2?", "chosen": "3", "rejected": "4"},
        {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": " 4 "},  # same text: skipped
        {"prompt": "What is 9 + 9?", "chosen": "18", "rejected": "81"},
    )
    pairs, stats = build_preference_dataset(data, tokenizer, fmt="prompt_response", max_length=64)
    assert stats == {
        "rows": 3,
        "kept": 2,
        "skipped_identical": 1,
        "dropped_too_long": 0,
        "longest": len(encode_prompt_response(tokenizer, "What is 9 + 9?", "18")["input_ids"]),
    }
    assert pairs[0]["chosen"] == encode_prompt_response(tokenizer, "What is 1 + 2?", "3")
    # the response "4" and its <|im_end|> are the scored tokens
    rejected = pairs[0]["rejected"]
    scored = [t for t, m in zip(rejected["input_ids"], rejected["loss_mask"], strict=True) if m]
    assert scored == [ord("4"), END]


def test_rows_missing_chosen_or_rejected_are_errors(tokenizer) -> None:
    with pytest.raises(DataError, match="no column 'rejected'"):
        build_preference_dataset(
            rows({"prompt": "p", "chosen": "a"}), tokenizer, fmt="prompt_response", max_length=64
        )
    blank = rows(
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": None, "rejected": "b"},
    )
    with pytest.raises(DataError, match="Row 1 of the preference data has no 'chosen'"):
        build_preference_dataset(blank, tokenizer, fmt="prompt_response", max_length=64)
    same = rows({"prompt": "p", "chosen": "a", "rejected": "a"})
    with pytest.raises(DataError, match="1 with chosen == rejected"):
        build_preference_dataset(same, tokenizer, fmt="prompt_response", max_length=64)


def test_too_long_pairs_are_dropped_and_counted(tokenizer) -> None:
    data = rows(
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "chosen": "a", "rejected": "b" * 100},
    )
    pairs, stats = build_preference_dataset(data, tokenizer, fmt="prompt_response", max_length=40)
    assert len(pairs) == 1 and stats["dropped_too_long"] == 1


def test_messages_score_only_the_last_assistant_turn(tokenizer) -> None:
    context = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
    ]
    data = rows(
        {
            "chosen": [*context, {"role": "assistant", "content": "4"}],
            "rejected": [*context, {"role": "assistant", "content": "5"}],
        }
    )
    pairs, _ = build_preference_dataset(data, tokenizer, fmt="messages", max_length=256)
    for side, answer in (("chosen", "4"), ("rejected", "5")):
        ex = pairs[0][side]
        scored = [t for t, m in zip(ex["input_ids"], ex["loss_mask"], strict=True) if m]
        assert scored == [ord(answer), END]  # "hello" (an earlier turn) is not scored
    prompt = prompt_ids(tokenizer, data[0], fmt="messages")
    assert pairs[0]["chosen"]["input_ids"][: len(prompt)] == prompt
    # A text prompt beside full conversations (ultrafeedback_binarized) is not prepended;
    # a prompt column of messages is (TRL's explicit-prompt format).
    with_text = data.add_column("prompt", ["2+2?"])
    assert (
        build_preference_dataset(with_text, tokenizer, fmt="messages", max_length=256)[0] == pairs
    )
    split = rows(
        {
            "prompt": context,
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        }
    )
    assert build_preference_dataset(split, tokenizer, fmt="messages", max_length=256)[0] == pairs
    different = rows(
        {
            "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "4"}],
            "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "5"}],
        }
    )
    with pytest.raises(DataError, match="differ before their last message"):
        build_preference_dataset(different, tokenizer, fmt="messages", max_length=256)


def test_collate_interleaves_chosen_and_rejected(tokenizer) -> None:
    data = rows(
        {"prompt": "p", "chosen": "a", "rejected": "bb"},
        {"prompt": "q", "chosen": "c", "rejected": "d"},
    )
    pairs, _ = build_preference_dataset(data, tokenizer, fmt="prompt_response", max_length=64)
    batch = collate_pairs(pairs, pad_id=tokenizer.pad_token_id)
    assert batch.tensors["pair_side"].tolist() == [0, 1, 0, 1]
    lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    # rows: p/a, p/bb (one byte longer), q/c, q/d
    assert lengths[1] == lengths[0] + 1 and lengths[2] == lengths[3] == lengths[0]


def test_near_miss_is_wrong_and_non_negative() -> None:
    rng = random.Random(0)
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            for op, value in (("+", a + b), ("-", abs(a - b))):
                hi, lo = max(a, b), min(a, b)
                prompt = f"What is {hi if op == '-' else a} {op} {lo if op == '-' else b}?"
                wrong = near_miss(prompt, str(value), rng)
                assert wrong.isdigit() and wrong != str(value)


def test_shipped_pairs_regenerate_byte_identically(tmp_path: Path) -> None:
    paths = write_arith_pairs(tmp_path)
    for split in ("train", "test"):
        shipped = ROOT / "data" / "tiny-arith-pairs" / f"{split}.jsonl"
        assert paths[split].read_bytes() == shipped.read_bytes()
    # the held-out pairs ask exactly the held-out problems of the SFT data
    prompts = [line.split('"prompt": ')[1].split(",")[0] for line in paths["test"].open()]
    sft = [
        line.split('"prompt": ')[1].split(",")[0]
        for line in (ROOT / "data/tiny-arith/test.jsonl").open()
    ]
    assert prompts == sft
