"""Chat history and settings checks of `roll generate` (no model loaded)."""

from __future__ import annotations

import pytest

from roll_core.errors import UsageError
from roll_core.evaluation import Chat, GenerateSettings
from roll_core.evaluation.generate import check_generate_settings


class EchoGenerator:
    """Stands in for Generator: records what it was sent, replies with the turn number."""

    def __init__(self) -> None:
        self.sent: list[list[dict[str, str]]] = []

    def reply(self, messages: list[dict[str, str]]) -> str:
        self.sent.append([dict(m) for m in messages])
        return f"reply {len(self.sent)}"


def test_chat_keeps_history_and_reset_keeps_the_system_prompt() -> None:
    gen = EchoGenerator()
    chat = Chat(gen, system="Be brief.")  # type: ignore[arg-type]
    assert chat.say("a") == "reply 1"
    assert chat.say("b") == "reply 2"
    assert gen.sent[1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "b"},
    ]
    chat.reset()
    chat.say("c")
    assert gen.sent[2] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "c"},
    ]
    assert Chat(gen).messages == []  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "--max-new-tokens must be at least 1"),
        ({"temperature": -1.0}, "--temperature must be >= 0"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1]"),
        ({"backend": "x"}, "valid: hf, vllm"),
    ],
)
def test_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("]", r"\]")):
        check_generate_settings(GenerateSettings(**kwargs))
