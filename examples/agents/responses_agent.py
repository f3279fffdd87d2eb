"""The calculator agent written with the OpenAI Responses API: roll trains it unchanged.

Same task and reward as calculator_agent.py (a product "37*48"; one ``calc`` tool; reward 1
for the right answer), but the model calls go through ``client.responses`` (the API of the
OpenAI Agents SDK and Codex): the first call streams (``stream=True``), the next ones send
only the tool results and continue the conversation with ``previous_response_id``. roll hands
``run`` an ``openai`` client whose ``base_url`` is the episode's session. Outside roll the same
file runs against any server of the Responses API: ``run(openai.OpenAI(), make_task(0))``.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

TOOLS = [
    {
        "type": "function",
        "name": "calc",
        "description": "Multiply two numbers.",
        "parameters": {
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
    events = client.responses.create(
        model="policy", instructions="Use calc.", input=task["question"], tools=TOOLS, stream=True
    )  # the last event carries the response (response.completed, or .incomplete when cut)
    response = [e for e in events if e.type in ("response.completed", "response.incomplete")][-1]
    response = response.response
    for _ in range(max_turns - 1):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            break
        results = []
        for call in calls:
            try:
                x = str(json.loads(call.arguments or "{}").get("x", ""))
            except (json.JSONDecodeError, AttributeError):
                x = ""
            results.append({"type": "function_call_output", "call_id": call.call_id,
                            "output": calc(x)})  # fmt: skip
        response = client.responses.create(
            model="policy",
            instructions="Use calc.",  # not carried over by previous_response_id
            previous_response_id=response.id,
            input=results,
            tools=TOOLS,
        )
    if any(item.type == "function_call" for item in response.output):
        return 0.0
    answer = response.output_text.strip().rstrip(".")
    return 1.0 if answer == str(task["answer"]) else 0.0


def expert(task: dict[str, Any], messages: list[dict[str, Any]]) -> Any:
    """What a good model answers (the warm start clones it)."""
    if messages[-1]["role"] == "tool":
        return messages[-1]["content"]
    return {"tool_calls": [{"name": "calc", "arguments": {"x": task["question"]}}]}
