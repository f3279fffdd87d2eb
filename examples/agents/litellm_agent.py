"""The calculator agent written with litellm, streaming: roll trains it unchanged.

Same task and reward as calculator_agent.py (a product "37*48"; one ``calc`` tool; reward 1
for the right answer), but the model calls go through ``litellm.completion(...,
stream=True)``, as agents built on litellm (and the frameworks on top of it) make them. roll
hands ``run`` an ``openai`` client whose ``base_url`` is the episode's session; a litellm agent
points ``api_base`` there. Outside roll the same file runs against any OpenAI-compatible
server: ``run(openai.OpenAI(base_url=...), make_task(0))``.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import litellm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Multiply two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "description": "e.g. 12*34"}},
                "required": ["x"],
            },
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
    messages: list[Any] = [
        {"role": "system", "content": "Use calc."},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(max_turns):
        chunks = list(
            litellm.completion(
                model="openai/policy",
                api_base=str(client.base_url),
                api_key="roll",
                messages=messages,
                tools=TOOLS,
                stream=True,
                num_retries=0,
            )
        )
        message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
        calls = message.tool_calls or []
        reply: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
        if calls:
            reply["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ]
        messages.append(reply)
        if not calls:
            answer = (message.content or "").strip().rstrip(".")
            return 1.0 if answer == str(task["answer"]) else 0.0
        for c in calls:
            try:
                x = str(json.loads(c.function.arguments or "{}").get("x", ""))
            except (json.JSONDecodeError, AttributeError):
                x = ""
            messages.append({"role": "tool", "tool_call_id": c.id, "content": calc(x)})
    return 0.0


def expert(task: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    """What a good model answers (the warm start clones it)."""
    if messages[-1]["role"] == "tool":
        return messages[-1]["content"]
    return {"tool_calls": [{"name": "calc", "arguments": {"x": task["question"]}}]}
