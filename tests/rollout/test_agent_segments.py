"""Agent calls that do not continue one conversation (``rollout.agent_history``): a new
training segment (``segment``) or HTTP 400 (``strict``), on hand-built conversations with the
real built-in tokenizer and the compact tool template of the FrozenLake agent.

The scripted model answers every call with ``<tool_call>`` move right + eos, its token ``i``
with log-prob ``-(i + 1) / 100``. ``<|im_end|>`` is the eos, so the template's ids after a
generated answer start after it (token-in/token-out, rollout/agentic/chat.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roll_core.backends.infer import Completion
from roll_core.config import load_recipe
from roll_core.errors import ConfigError
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.models.loading import use_chat_template
from roll_core.rollout.agentic import ChatFormat, Trajectory, step_batch, trajectory_batch
from roll_core.rollout.agentic.endpoint import (
    AgentSession,
    EndpointError,
    chat_completion,
    prompt_key,
)

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = str(ROOT / "examples/agents/chatml-tools.jinja")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move one cell.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string"}},
                "required": ["direction"],
            },
        },
    }
]
MOVE = '<tool_call>\n{"name": "move", "arguments": {"direction": "right"}}\n</tool_call>'
# the template's text of a first call (hand-written from examples/agents/chatml-tools.jinja)
FIRST = (
    "<|im_start|>system\nTool move: Move one cell. Args: direction\n<|im_end|>\n"
    "<|im_start|>user\n{lake}<|im_end|>\n<|im_start|>assistant\n"
)
TOOL_TURN = "\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tokenizer = load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("m"))))
    use_chat_template(tokenizer, TEMPLATE)
    return tokenizer


def enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def new_session(tok: Any, history: str, group: int = 0) -> AgentSession:
    def generate(prompt: list[int], turn: int, vision: Any, params: Any = None) -> Completion:
        ids = enc(tok, MOVE) + [tok.eos_token_id]
        return Completion(turn, ids, [-(i + 1) / 100 for i in range(len(ids))], "stop", 3)

    traj = Trajectory("lake", group, 0, 0)
    return AgentSession(traj, ChatFormat(tok), generate, 80, 512, "m", history=history)


def call(s: AgentSession, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return chat_completion(s, {"model": "policy", "messages": messages, "tools": TOOLS})


def lake(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_continuation_then_new_segment_token_in_token_out(tok: Any) -> None:
    s = new_session(tok, "segment")
    first = enc(tok, FIRST.format(lake="PFF/FHF/FFG"))
    gen = enc(tok, MOVE) + [tok.eos_token_id]
    out = call(s, lake("PFF/FHF/FFG"))
    assistant = out["choices"][0]["message"]
    assert assistant["tool_calls"][0]["function"]["name"] == "move"
    # a continuing call: the earlier messages, the answer unchanged, a tool result
    call_id = assistant["tool_calls"][0]["id"]
    convo = [*lake("PFF/FHF/FFG"), assistant, {"role": "tool", "tool_call_id": call_id}]
    convo[-1]["content"] = "SPF/FHF/FFG"
    call(s, convo)
    tool_ids = enc(tok, TOOL_TURN.format(result="SPF/FHF/FFG"))
    assert s.traj.turns[1].prompt_ids == first + gen + tool_ids  # same segment, appended
    # a call with only the current lake: a new segment, rendered as a first call
    call(s, lake("SFF/FHP/FFG"))
    third = enc(tok, FIRST.format(lake="SFF/FHP/FFG"))
    assert s.traj.turns[2].prompt_ids == third
    assert [t.segment for t in s.traj.turns] == [0, 0, 1]
    [closed] = s.traj.segments
    assert closed.ids == first + gen + tool_ids + gen
    assert closed.mask == [0] * len(first) + [1] * len(gen) + [0] * len(tool_ids) + [1] * len(gen)
    assert s.traj.trace.ids == third + gen
    assert s.traj.trace.mask == [0] * len(third) + [1] * len(gen)
    logps = [-(i + 1) / 100 for i in range(len(gen))]
    assert [lp for lp, m in zip(s.traj.trace.log_probs, s.traj.trace.mask, strict=True) if m] == (
        logps
    )
    # the same lake again (a move into the edge): a third segment with the same state key
    call(s, lake("SFF/FHP/FFG"))
    assert len(s.traj.traces()) == 3 and s.traj.turns[3].prompt_ids == third
    assert s.traj.turns[3].state_key == s.traj.turns[2].state_key == prompt_key(third)
    assert s.traj.turns[0].state_key != s.traj.turns[2].state_key


def test_strict_refuses_a_call_that_does_not_continue(tok: Any) -> None:
    s = new_session(tok, "strict")
    call(s, lake("PFF/FHF/FFG"))
    with pytest.raises(EndpointError, match=r"messages\[0\] differs") as err:
        call(s, lake("SPF/FHF/FFG"))
    assert err.value.status == 400
    with pytest.raises(EndpointError, match="tools differ"):
        chat_completion(s, {"model": "policy", "messages": lake("PFF/FHF/FFG")})
    assert len(s.traj.turns) == 1 and s.traj.segments == []


def test_segments_are_rows_with_the_episode_return_and_prompt_anchors(tok: Any) -> None:
    a, b = new_session(tok, "segment", group=5), new_session(tok, "segment", group=5)
    for s, lakes in ((a, ["PFF/FHF/FFG", "SPF/FHF/FFG"]), (b, ["PFF/FHF/FFG", "SFF/PHF/FFG"])):
        for text in lakes:
            call(s, lake(text))
    a.traj.episode_return, b.traj.episode_return = 1.0, 0.0
    a.traj.turns[-1].reward = 1.0
    n_gen = len(enc(tok, MOVE)) + 1
    batch = trajectory_batch([[a.traj, b.traj]], pad_id=tok.pad_token_id)
    assert batch.tensors["scores"].tolist() == [1.0, 1.0, 0.0, 0.0]  # one row per segment
    assert batch.tensors["group_ids"].tolist() == [0, 0, 0, 0]
    assert batch.tensors["response_lengths"].tolist() == [n_gen] * 4
    assert batch.tensors["policy_versions"].tolist() == [3] * 4
    steps = step_batch([[a.traj, b.traj]], pad_id=tok.pad_token_id, gamma=0.5)
    # both first calls saw the same lake (one state); the second calls saw different lakes
    assert steps.tensors["anchor_ids"].tolist() == [0, 1, 0, 2]
    assert steps.tensors["step_returns"].tolist() == [0.5, 1.0, 0.0, 0.0]
    assert steps.tensors["step_episode"].tolist() == [0, 0, 1, 1]


def test_lake_recipe_validates_and_agent_history_is_checked(tmp_path: Path) -> None:
    cfg: Any = load_recipe(ROOT / "recipes/tiny-frozenlake-agent-lake.yaml")
    assert (cfg.rollout.mode, cfg.rollout.agent_history) == ("step", "segment")
    assert cfg.envs[0].options["history"] == "lake"
    with pytest.raises(ConfigError, match="agent_history"):
        load_recipe(
            ROOT / "recipes/tiny-frozenlake-agent-lake.yaml", ["rollout.agent_history=loose"]
        )
