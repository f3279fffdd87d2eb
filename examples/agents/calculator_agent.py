"""A tool-calling agent written as plain OpenAI-client code: it never imports roll.

Each task is a product of two numbers ("37*48"). The agent declares one tool, ``calc``, asks
the model, runs every tool call the model makes and sends the results back as ``tool``
messages, until the model answers without a call. The reward is 1 when the answer is the
product (a success); otherwise partial credit, not a success: 0.25 per factor the ``calc``
call copied right, plus 0.25 for answering with the tool's result. Trained with ``roll train
agentic recipes/tiny-calc-agent.yaml`` (docs/agentic.md, "Bring your own agent"); the same
file runs against any OpenAI-compatible server: ``run(openai.AsyncOpenAI(base_url=...),
make_task(0))``.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

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
    """The task of an episode (roll calls it with the episode's seed and envs[].options)."""
    rng = random.Random(seed)
    a, b = rng.randint(low, high), rng.randint(low, high)
    return {"question": f"{a}*{b}", "answer": a * b}


def calc(x: str) -> str:
    found = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", x)
    if found is None:
        return f"error: calc takes A*B, got {x!r}"
    return str(int(found.group(1)) * int(found.group(2)))


async def run(client: Any, task: dict[str, Any], max_turns: int = 3) -> dict[str, Any]:
    messages: list[Any] = [
        {"role": "system", "content": "Use calc."},
        {"role": "user", "content": task["question"]},
    ]
    credit = 0.0  # partial credit: a step in the right direction, not a success
    result = None  # the last tool result the model saw
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS
        )
        message = response.choices[0].message
        messages.append(message)  # the assistant message as returned, unchanged
        if not message.tool_calls:
            answer = (message.content or "").strip().rstrip(".")
            if answer == str(task["answer"]):
                return {"reward": 1.0, "success": True}
            if result is not None and answer == result:
                credit += 0.25  # it read the tool's result back, though the call was wrong
            break
        for call in message.tool_calls:
            try:
                x = str(json.loads(call.function.arguments).get("x", ""))
            except (json.JSONDecodeError, AttributeError):
                x = ""
            asked = x.replace(" ", "").split("*")
            wanted = task["question"].split("*")
            right = (
                sum(a == b for a, b in zip(asked, wanted, strict=False)) if len(asked) == 2 else 0
            )
            credit = max(credit, 0.25 * right)  # each factor copied right
            result = calc(x)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": credit, "success": False}


def expert(task: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    """What a good model answers to a call (roll's warm start clones it): call calc on the
    question, then answer with its result."""
    if messages[-1]["role"] == "tool":
        return messages[-1]["content"]
    return {"tool_calls": [{"name": "calc", "arguments": {"x": task["question"]}}]}
