"""The one place roll renders a conversation with a tokenizer's chat template.

Every caller that turns messages into a prompt (SFT/DPO tokenisation, the agentic rollout's
token-in/token-out pieces, the model policy of `roll debug-env`, the LLM judge) goes through
:func:`render_chat` (text) or :func:`encode_chat` (token ids), so the template is applied the
same way everywhere.

``fold_system=True`` retries a conversation the template rejects with its system message folded
into the first turn (``system + "\\n\\n" + first["content"]`` as a user message), for templates
that refuse a system role (e.g. Gemma's). Errors other callers should see are re-raised as-is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    fold_system: bool = False,
) -> str:
    """The chat-template text of ``messages`` (with the assistant generation header if asked)."""
    out = _apply(tokenizer, messages, add_generation_prompt, fold_system, tokenize=False)
    return str(out)


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    fold_system: bool = False,
) -> list[int]:
    """Token ids of ``messages`` as the template tokenises them (no extra special tokens).

    transformers 5 returns a ``BatchEncoding`` from ``apply_chat_template(tokenize=True)``,
    transformers 4 a plain list; both give the same ids here."""
    out = _apply(tokenizer, messages, add_generation_prompt, fold_system, tokenize=True)
    return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]


def _apply(
    tokenizer: Any,
    messages: Sequence[Message],
    add_generation_prompt: bool,
    fold_system: bool,
    *,
    tokenize: bool,
) -> Any:
    conversation = [dict(m) for m in messages]
    try:
        return tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize
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
        )
