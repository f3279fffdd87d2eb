"""The calculator agent written with the ``anthropic`` client: roll trains it unchanged.

Same task and reward as calculator_agent.py (a product "37*48"; one ``calc`` tool; reward 1
for the right answer), but the model calls go through Anthropic Messages, streamed
(``messages.stream``), with ``tool_use`` / ``tool_result`` blocks, as Claude-Code-style
harnesses make them. roll hands ``run`` an ``openai`` client whose ``base_url`` is the episode's
session (``.../s/<token>/v1/``); an Anthropic client takes that URL without ``/v1`` (in a
harness: ``ANTHROPIC_BASE_URL``). Outside roll the same file runs against Anthropic's API.
"""

from __future__ import annotations

import random
import re
from typing import Any

import anthropic

TOOLS = [
    {
        "name": "calc",
        "description": "Multiply two numbers.",
        "input_schema": {
            "type": "object",
            "properties": {"x": {"type": "string", "description": "e.g. 12*34"}},
            "required": ["x"],
        },
    }
]


def make_task(seed: int, low: int = 10, high: int = 99) -> dict[str, Any]:
    rng = random.Random(seed)
    a, b = rng.randint(low, high), rng.randint(low, high)
    return {"question": f"{a}*{b}", "answer": a * b}


def calc(x: str) -> str:
    found = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", x)
    return str(int(found.group(1)) * int(found.group(2))) if found else f"error: got {x!r}"


def run(client: Any, task: dict[str, Any], max_turns: int = 3) -> float:
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=base, api_key="roll", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": task["question"]}]
    for _ in range(max_turns):
        with claude.messages.stream(
            model="policy", max_tokens=256, system="Use calc.", messages=messages, tools=TOOLS
        ) as stream:
            message = stream.get_final_message()
        messages.append({"role": "assistant", "content": message.content})
        uses = [block for block in message.content if block.type == "tool_use"]
        if not uses:
            text = "".join(block.text for block in message.content if block.type == "text")
            return 1.0 if text.strip().rstrip(".") == str(task["answer"]) else 0.0
        results = [
            {"type": "tool_result", "tool_use_id": use.id, "content": calc(str(use.input.get("x", "")))}
            for use in uses
        ]  # fmt: skip
        messages.append({"role": "user", "content": results})
    return 0.0


def expert(task: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    """What a good model answers (the warm start clones it)."""
    if messages[-1]["role"] == "tool":
        return messages[-1]["content"]
    return {"tool_calls": [{"name": "calc", "arguments": {"x": task["question"]}}]}
