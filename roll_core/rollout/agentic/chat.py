"""Token ids of a multi-turn conversation with an env, built without re-tokenising generations.

Token-in/token-out: the ids of a trajectory are the first prompt (system + first observation,
rendered by the model's chat template), then for every turn the ids the model *generated*
(exactly, eos included) and the ids of the env's reply. The env's reply is the chat template's
text between an assistant message and the next generation prompt (ChatML:
``<|im_end|>\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n``), found once
by rendering two dummy conversations and taking the difference. When the generation already
ended with the eos token that closes the assistant turn, that token is not repeated.

Only generated ids carry a loss-mask 1 and a behaviour log-prob; everything the env or the
template wrote is masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll_core.data.chat import render_chat

_SENTINEL = "ROLL_SENTINEL_7f3a"


class ChatFormat:
    """The chat-template pieces of one tokenizer, as token ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.eos_token_id
        base = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": _SENTINEL},
        ]
        text_base = self._text(base, generation_prompt=False)
        probe = "ROLL_OBSERVATION_PROBE"
        text_full = self._text([*base, {"role": "user", "content": probe}], True)
        if not text_full.startswith(text_base) or _SENTINEL not in text_base:
            raise ValueError("the chat template does not render conversations incrementally")
        close = text_base.split(_SENTINEL)[-1]  # e.g. "<|im_end|>\n"
        before, _, after = text_full[len(text_base) :].partition(probe)
        self._env_prefix = close + before  # e.g. "<|im_end|>\n<|im_start|>user\n"
        self._env_suffix = after  # e.g. "<|im_end|>\n<|im_start|>assistant\n"

    def _text(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return render_chat(
            self.tokenizer, messages, add_generation_prompt=generation_prompt, fold_system=True
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of ``messages`` rendered with the generation prompt."""
        return self.encode(self._text(messages, True))

    def env_message(self, observation: str, *, after_eos: bool) -> list[int]:
        """Ids of the env's reply after an assistant turn (closing that turn if needed)."""
        ids = self.encode(self._env_prefix + observation + self._env_suffix)
        if after_eos and ids and ids[0] == self.eos_id:
            ids = ids[1:]
        return ids


def first_messages(system: str, observation: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": observation}]


@dataclass
class TokenTrace:
    """The ids of a whole trajectory, its loss mask and behaviour log-probs (same length)."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)

    def add_context(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)

    def add_generated(self, ids: list[int], log_probs: list[float]) -> None:
        if len(ids) != len(log_probs):
            raise ValueError(f"{len(ids)} generated ids but {len(log_probs)} log-probs")
        self.ids += ids
        self.mask += [1] * len(ids)
        self.log_probs += list(log_probs)
