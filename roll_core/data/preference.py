"""Pairwise preference data: the tiny arithmetic pairs, tokenisation and collation for DPO.

**Rows.** ``prompt_response`` rows hold a ``prompt`` string and two responses, ``chosen``
(preferred) and ``rejected``. ``messages`` rows hold ``chosen`` and ``rejected`` chat
conversations (lists of ``{role, content}``) whose last message is the assistant answer being
compared, optionally after a shared ``prompt`` column of messages (TRL's conversational
format); everything before the last message must be the same in both. Only the final assistant
turn is scored: its tokens and its end-of-turn token, as in SFT (roll_core/data/sft.py). A
``prompt`` column of plain text is ignored in this format (HuggingFaceH4/ultrafeedback_binarized
keeps the prompt text next to conversations that already begin with it).

**Bad rows.** A missing column or a row whose prompt, chosen or rejected is blank raises a
:class:`~roll_core.errors.DataError` naming the row. A pair whose chosen and rejected are the
same text carries no preference: it is skipped and counted (``skipped_identical``). Pairs with
either side longer than ``max_length`` tokens are dropped and counted, never truncated.

**The arithmetic pairs.** ``write_arith_pairs`` turns the problems of
:func:`roll_core.data.arith.write_arith_dataset` (same seed, so the test problems are exactly
those of ``data/tiny-arith/test.jsonl`` and the train problems the first ones of its train
split) into pairs whose chosen response is the right answer and whose rejected response is a
near miss of the kind a small model makes: off by one or by ten, swapped digits, or the result
of the other operation. ``data/tiny-arith-pairs/`` is ``write_arith_pairs(...)`` with defaults.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from roll_core.data.arith import write_arith_dataset
from roll_core.data.batch import Batch
from roll_core.data.chat import encode_chat
from roll_core.data.sft import collate_sft, encode_messages, encode_prompt, encode_prompt_response
from roll_core.data.sources import require_columns
from roll_core.errors import DataError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

Example = dict[str, list[int]]
Pair = dict[str, Example]
"""``{"chosen": example, "rejected": example}``, each with ``input_ids`` and ``loss_mask``."""

# -- the arithmetic pairs ---------------------------------------------------------------------


def near_miss(prompt: str, answer: str, rng: random.Random) -> str:
    """A wrong answer (a non-negative integer) close to ``answer`` for ``What is a OP b?``."""
    value = int(answer)
    a, op, b = prompt.removeprefix("What is ").removesuffix("?").split()
    other = int(a) - int(b) if op == "+" else int(a) + int(b)
    digits = answer[::-1] if len(answer) > 1 else answer
    candidates = [value + 1, value - 1, value + 10, value - 10, int(digits), other]
    choice = candidates[min(int(rng.random() * len(candidates)), len(candidates) - 1)]
    if choice < 0 or choice == value:
        choice = value + 1
    return str(choice)


def arith_pairs(rows: Sequence[Mapping[str, str]], *, seed: int) -> list[dict[str, str]]:
    """One pair per arithmetic row: ``{prompt, chosen, rejected, answer}``."""
    rng = random.Random(seed)
    return [
        {
            "prompt": row["prompt"],
            "chosen": row["answer"],
            "rejected": near_miss(row["prompt"], row["answer"], rng),
            "answer": row["answer"],
        }
        for row in rows
    ]


def write_arith_pairs(
    out_dir: str | Path, *, n_train: int = 5000, n_test: int = 500, seed: int = 0
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` of arithmetic pairs; return their paths."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_arith_dataset(tmp, n_train=n_train, n_test=n_test, seed=seed)
        splits = {
            split: [json.loads(line) for line in path.read_text().splitlines() if line]
            for split, path in paths.items()
        }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, pair_seed in (("train", seed + 1), ("test", seed)):  # as write_arith_dataset
        target = out / f"{split}.jsonl"
        pairs = arith_pairs(splits[split], seed=pair_seed)
        target.write_text(
            "".join(json.dumps(p, ensure_ascii=True) + "\n" for p in pairs),
            encoding="utf-8",
            newline="\n",
        )
        written[split] = target
    return written


# -- tokenisation -----------------------------------------------------------------------------


def build_preference_dataset(
    rows: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    fmt: Literal["prompt_response", "messages"],
    max_length: int,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    what: str = "the preference data",
) -> tuple[list[Pair], dict[str, int]]:
    """Encode every row into a pair; skip identical pairs, drop over-long ones (both counted).

    Returns the pairs and ``{"rows", "kept", "skipped_identical", "dropped_too_long",
    "longest"}``.
    """
    if fmt == "prompt_response":
        required = [prompt_key, chosen_key, rejected_key]
    elif fmt == "messages":
        required = [chosen_key, rejected_key]
    else:
        raise DataError(f"Unknown preference data format {fmt!r}; use prompt_response or messages.")
    require_columns(
        rows,
        required,
        what=what,
        hint="Preference rows need a prompt, a chosen and a rejected response: rename the "
        "columns or set data.prompt_key / data.chosen_key / data.rejected_key.",
    )
    has_prompt = prompt_key in rows.column_names
    pairs: list[Pair] = []
    stats = {"rows": 0, "kept": 0, "skipped_identical": 0, "dropped_too_long": 0, "longest": 0}
    for index, row in enumerate(rows):
        stats["rows"] += 1
        prompt = row[prompt_key] if has_prompt else None
        chosen, rejected = row[chosen_key], row[rejected_key]
        for key, value in ((chosen_key, chosen), (rejected_key, rejected)):
            _require_value(value, key, index, what)
        keys = (prompt_key, chosen_key, rejected_key)
        if fmt == "prompt_response":
            made = _text_pair(tokenizer, (prompt, chosen, rejected), keys, index, what)
        else:
            made = _messages_pair(tokenizer, (prompt, chosen, rejected), keys, index, what)
        if made is None:  # chosen == rejected
            stats["skipped_identical"] += 1
            continue
        pair = made
        longest = max(len(pair["chosen"]["input_ids"]), len(pair["rejected"]["input_ids"]))
        stats["longest"] = max(stats["longest"], longest)
        if longest > max_length:
            stats["dropped_too_long"] += 1
            continue
        pairs.append(pair)
    stats["kept"] = len(pairs)
    if not pairs:
        raise DataError(
            f"{what} has no usable pair: {stats['rows']} rows, {stats['skipped_identical']} with "
            f"chosen == rejected, {stats['dropped_too_long']} longer than data.max_length="
            f"{max_length} tokens.",
            hint=f"Raise data.max_length to at least {stats['longest']}"
            if stats["dropped_too_long"]
            else "Point the recipe at pairs whose chosen and rejected responses differ.",
        )
    return pairs, stats


def _text_pair(
    tokenizer: PreTrainedTokenizerBase,
    values: tuple[Any, Any, Any],
    keys: tuple[str, str, str],
    index: int,
    what: str,
) -> Pair | None:
    """Row ``index`` in the prompt_response format (``values``: prompt, chosen, rejected,
    from the columns ``keys``) encoded; None when chosen and rejected are the same text."""
    prompt_key, chosen_key, rejected_key = keys
    prompt, chosen, rejected = values
    _require_value(prompt, prompt_key, index, what)
    prompt, chosen, rejected = (
        _text(v, k, index)
        for v, k in ((prompt, prompt_key), (chosen, chosen_key), (rejected, rejected_key))
    )
    if chosen.strip() == rejected.strip():
        return None
    return {
        "chosen": encode_prompt_response(tokenizer, prompt, chosen),
        "rejected": encode_prompt_response(tokenizer, prompt, rejected),
    }


def _messages_pair(
    tokenizer: PreTrainedTokenizerBase,
    values: tuple[Any, Any, Any],
    keys: tuple[str, str, str],
    index: int,
    what: str,
) -> Pair | None:
    """Row ``index`` in the messages format (``values``: prompt or None, chosen and rejected
    conversations, from the columns ``keys``) encoded as its last turns; None when the last
    messages are the same text."""
    _, chosen_key, rejected_key = keys
    prompt, chosen, rejected = values
    conv_c, conv_r = (
        _conversation(prompt, conv, key, index)
        for conv, key in ((chosen, chosen_key), (rejected, rejected_key))
    )
    if conv_c[:-1] != conv_r[:-1]:
        raise DataError(
            f"Row {index} of {what}: the {chosen_key!r} and {rejected_key!r} "
            "conversations differ before their last message, so they do not answer "
            "the same prompt.",
            hint="Put the shared turns in both conversations (or in the prompt column) "
            "and make only the last assistant message differ.",
        )
    if conv_c[-1]["content"].strip() == conv_r[-1]["content"].strip():
        return None
    return {
        "chosen": _last_turn(tokenizer, conv_c),
        "rejected": _last_turn(tokenizer, conv_r),
    }


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    row: Mapping[str, Any],
    *,
    fmt: Literal["prompt_response", "messages"],
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
) -> list[int]:
    """Token ids of a row's prompt followed by the assistant generation header."""
    if fmt == "prompt_response":
        return encode_prompt(tokenizer, str(row[prompt_key]))
    context = _conversation(row.get(prompt_key), row[chosen_key], chosen_key, 0)[:-1]
    return encode_chat(tokenizer, context, add_generation_prompt=True)


def collate_pairs(pairs: Sequence[Pair], *, pad_id: int) -> Batch:
    """Rows ``chosen_0, rejected_0, chosen_1, ...`` right-padded, plus ``pair_side`` (0, 1, ...)."""
    batch = collate_sft([p[side] for p in pairs for side in ("chosen", "rejected")], pad_id=pad_id)
    batch["pair_side"] = torch.tensor([0, 1] * len(pairs), dtype=torch.long)
    return batch


# -- helpers ----------------------------------------------------------------------------------


def _require_value(value: Any, key: str, index: int, what: str) -> None:
    blank = value is None or (isinstance(value, str | list) and not value)
    if isinstance(value, str) and not value.strip():
        blank = True
    if blank:
        raise DataError(
            f"Row {index} of {what} has no {key!r} (it is {value!r}); every preference row "
            "needs a prompt, a chosen and a rejected response.",
            hint="Remove or fix that row, or point data.*_key at the right columns.",
        )


def _text(value: Any, key: str, index: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DataError(
        f"Row {index} of column {key!r} is a {type(value).__name__}; the prompt_response "
        "format needs text there.",
        hint="Use data.format=messages for rows that hold chat messages.",
    )


def _conversation(prompt: Any, conv: Any, key: str, index: int) -> list[dict[str, Any]]:
    """``prompt`` messages (if a list) + ``conv``; the last message must be the assistant's.

    A string prompt is ignored: datasets such as ultrafeedback_binarized keep the prompt text
    beside conversations that already start with it.
    """
    if not isinstance(prompt, list):
        prompt = None
    messages = [*(prompt or []), *(conv if isinstance(conv, list) else [])]
    if not isinstance(conv, list) or not all(
        isinstance(m, Mapping)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise DataError(
            f"Row {index} of column {key!r} is not a list of {{'role', 'content'}} messages.",
            hint="Use data.format=prompt_response for rows that hold plain text.",
        )
    if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
        raise DataError(
            f"Row {index} of column {key!r}: the last message must be a non-empty assistant "
            "answer (the response being compared).",
        )
    return [dict(m) for m in messages]


def _last_turn(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> Example:
    """``encode_messages`` with the loss mask kept on the last assistant turn only."""
    example = encode_messages(tokenizer, messages)
    mask = example["loss_mask"]
    end = len(mask)
    while end > 0 and not mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    example["loss_mask"] = [1 if start <= i < end else 0 for i in range(len(mask))]
    return example
