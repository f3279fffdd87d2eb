"""The one place roll renders a conversation with a tokenizer's chat template.

Every caller that turns messages into a prompt (SFT/DPO tokenisation, the agentic rollout's
token-in/token-out pieces, the model policy of `roll debug-env`, the LLM judge) goes through
:func:`render_chat` (text) or :func:`encode_chat` (token ids), so the template is applied the
same way everywhere. Vision-language models: :func:`image_message` builds a user turn with image
parts and :func:`encode_chat_images` gives its token ids (placeholders expanded) and the
images' :class:`~roll_core.data.vision.VisionInputs`.

``fold_system=True`` retries a conversation the template rejects with its system message folded
into the first turn (``system + "\\n\\n" + first["content"]`` as a user message), for templates
that refuse a system role (e.g. Gemma's). Errors other callers should see are re-raised as-is.

:func:`prompt_turns` reads a dataset cell that holds a conversation (a list of
``{"role": ..., "content": ...}`` turns: verl's parquet files, many published RL datasets) and
refuses any other list with a DataError naming the row and column.

Tools (native tool calling): ``tools=`` passes JSON schemas in the OpenAI function format to
the template, which writes them into the system turn; :func:`tool_support_problem` says when a
template ignores them (it has no tool support), naming what is missing.

Reasoning templates (Qwen3: ``<think>...</think>``): :func:`reasoning_format` gives the markers
and the empty block the template writes itself before an answer, so an evaluation can strip the
reasoning block before comparing and count the block in its token budget.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roll_core.data.vision import VisionInputs
from roll_core.errors import DataError

Message = Mapping[str, Any]

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a conversation read from a dataset may use."""


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    fold_system: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The chat-template text of ``messages`` (with the assistant generation header if asked;
    ``tools``: the tool schemas the template renders)."""
    out = _apply(
        tokenizer, messages, add_generation_prompt, fold_system, tokenize=False, tools=tools
    )
    return str(out)


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    fold_system: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` as the template tokenises them (no extra special tokens).

    transformers 5 returns a ``BatchEncoding`` from ``apply_chat_template(tokenize=True)``,
    transformers 4 a plain list; both give the same ids here."""
    out = _apply(
        tokenizer, messages, add_generation_prompt, fold_system, tokenize=True, tools=tools
    )
    return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]


def _apply(
    tokenizer: Any,
    messages: Sequence[Message],
    add_generation_prompt: bool,
    fold_system: bool,
    *,
    tokenize: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Any:
    conversation = [dict(m) for m in messages]
    extra: dict[str, Any] = {"tools": [dict(t) for t in tools]} if tools else {}
    try:
        return tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **extra
        )
    except Exception:  # templates that refuse a system message: fold it into the first turn
        if not fold_system or len(conversation) < 2 or conversation[0]["role"] != "system":
            raise
        first = {
            "role": "user",
            "content": conversation[0]["content"] + "\n\n" + conversation[1]["content"],
        }
        return tokenizer.apply_chat_template(
            [first, *conversation[2:]],
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            **extra,
        )


def tool_support_problem(tokenizer: Any, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """Why ``tokenizer``'s chat template cannot show the model ``tools`` (None: it can).

    Renders ``[system, user]`` with the tools and checks that each tool's name, description
    and argument names appear in the text (Qwen writes each schema as JSON into the system
    turn; a template without tool support ignores ``tools`` and writes none of it)."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    try:
        text = render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools)
    except Exception as err:  # noqa: BLE001 - the template's own error, reported as such
        return f"rendering a conversation with tools= fails: {type(err).__name__}: {err}"
    missing = []
    for tool in tools:
        fn = tool.get("function", {})
        params = fn.get("parameters", {}).get("properties", {})
        for piece in [fn.get("name", ""), fn.get("description", ""), *params]:
            escaped = json.dumps(piece, ensure_ascii=False)[1:-1]  # as JSON writes it
            if piece and piece not in text and escaped not in text and piece not in missing:
                missing.append(piece)
    if missing:
        shown = ", ".join(repr(m if len(m) < 40 else m[:37] + "...") for m in missing[:4])
        return f"it does not write the tool schemas into the prompt ({shown} missing)"
    return None


def image_message(text: str, num_images: int) -> dict[str, Any]:
    """A user message with ``num_images`` image parts before its text (Qwen-VL's layout); plain
    text content when there is no image."""
    if not num_images:
        return {"role": "user", "content": text}
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def encode_chat_images(
    processor: Any,
    messages: Sequence[Message],
    images: Sequence[Any],
    *,
    add_generation_prompt: bool,
    fold_system: bool = False,
) -> tuple[list[int], VisionInputs | None]:
    """Token ids and vision inputs of a conversation whose ``{"type": "image"}`` parts take
    ``images`` in order (a vision-language model's :class:`~roll_core.models.vision.
    VisionProcessor`).

    The template writes one image placeholder per image part; each placeholder token becomes
    as many placeholder tokens as the image has merged patches (what Qwen-VL's processor does),
    so the ids are exactly what the model is fed. Raises ``ValueError`` when the number of
    placeholders differs from ``len(images)``."""
    text = render_chat(
        processor.tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        fold_system=fold_system,
    )
    pad = processor.image_token
    pieces = text.split(pad)
    if len(pieces) - 1 != len(images):
        raise ValueError(
            f"the chat template wrote {len(pieces) - 1} image placeholder(s) {pad!r} for "
            f"{len(images)} image(s)."
        )
    if not images:
        return [
            int(i) for i in processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        ], None
    vision = processor.process_images(images)
    counts = vision.num_image_tokens(processor.merge_size)
    expanded = pieces[0] + "".join(
        pad * n + rest for n, rest in zip(counts, pieces[1:], strict=True)
    )
    ids = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids], vision


def prompt_turns(value: Any, *, row: int, column: str, source: str) -> list[dict[str, Any]] | None:
    """The turns of a chat-formatted dataset cell, or None when ``value`` is not a list.

    Each turn must be a mapping with a ``role`` from :data:`CHAT_ROLES` and a text
    ``content``; keys whose value is None (parquet writes every key of the column's struct
    into every turn) are dropped, other keys (``name``, ``tool_calls``) are kept for the
    template; the last turn must not be the assistant's (the reply the model is to write).
    Anything else is a DataError naming ``row``, ``column`` and ``source``."""
    if not isinstance(value, list | tuple):
        return None
    where = f"Row {row} of column {column!r} in {source}"
    turns: list[dict[str, Any]] = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            raise DataError(
                f"{where} is a list, but its item {i} is a {type(turn).__name__} ({turn!r:.80}), "
                'not a chat turn {"role": ..., "content": ...}.',
                hint=f"Make every item of {column!r} a turn with a role and a text content, or "
                "point data.prompt_key at a text column.",
            )
        kept = {str(k): v for k, v in turn.items() if v is not None}
        role, content = kept.get("role"), kept.get("content")
        if role not in CHAT_ROLES:
            raise DataError(
                f"{where}: turn {i} has role {role!r}; the roles are {', '.join(CHAT_ROLES)}.",
                hint="Rename the role in the data (e.g. 'human' -> 'user', 'gpt' -> "
                "'assistant') or drop the row.",
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: turn {i} ({role}) has content of type {type(content).__name__}; "
                "prompt turns need text content.",
                hint="Give every turn a text `content` (image prompts: a text prompt column and "
                "data.image_key, see docs/vlm.md).",
            )
        turns.append(kept)
    if turns and turns[-1]["role"] == "assistant":
        raise DataError(
            f"{where} ends with an assistant turn; a prompt ends with the turn the model "
            "answers (user or tool), and an assistant turn there would put a reply, often the "
            "reference answer, into the prompt.",
            hint="Drop the final assistant turn from the data (an SFT-style `messages` column "
            "holds the answer), or train on such rows with `roll sft`.",
        )
    return turns


# ---- reasoning templates (Qwen3, DeepSeek-R1 style `<think>...</think>`) ----------------------
REASONING_MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)
"""(open, close) pairs of the reasoning blocks roll knows; a chat template that writes the close
marker is a reasoning template."""

_ANSWER_PROBE = "ROLL_ANSWER_PROBE_5c1e"


@dataclass(frozen=True)
class ReasoningFormat:
    """How a chat template frames an answer: its reasoning markers (None: not a reasoning
    template) and the ``preamble`` it writes itself between the generation prompt and the last
    assistant message's text (Qwen3: ``"<think>\\n\\n</think>\\n\\n"``, ChatML: ``""``), which a
    model trained on that template generates before its answer."""

    markers: tuple[str, str] | None
    preamble: str
    preamble_tokens: int

    def answer(self, text: str) -> str:
        """``text`` without its reasoning block: what follows the last close marker, leading
        newlines removed (as Qwen3's template reads an assistant turn); ``""`` when a block was
        opened and never closed (the budget ran out while reasoning)."""
        if self.markers is None:
            return text
        opening, closing = self.markers
        if closing in text:
            return text.rsplit(closing, 1)[1].lstrip("\n")
        return "" if opening in text else text


def reasoning_format(tokenizer: Any) -> ReasoningFormat:
    """The :class:`ReasoningFormat` of ``tokenizer``'s chat template."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    markers = next((pair for pair in REASONING_MARKERS if pair[1] in template), None)
    if not template:
        return ReasoningFormat(markers, "", 0)
    user = [{"role": "user", "content": "hi"}]
    prompt = render_chat(tokenizer, user, add_generation_prompt=True)
    full = render_chat(
        tokenizer,
        [*user, {"role": "assistant", "content": _ANSWER_PROBE}],
        add_generation_prompt=False,
    )
    if not full.startswith(prompt) or _ANSWER_PROBE not in full:
        return ReasoningFormat(markers, "", 0)
    preamble = full[len(prompt) : full.index(_ANSWER_PROBE)]
    count = len(tokenizer.encode(preamble, add_special_tokens=False)) if preamble else 0
    return ReasoningFormat(markers, preamble, count)
