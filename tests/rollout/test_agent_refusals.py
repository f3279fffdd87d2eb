"""What an agent call that is not answered leaves in its episode: nothing. A call refused for
the context (and the agent's retries of it) and a call whose client hung up before the reply
add no ids, no segment and no turn; and, as the last line of defence, the batch builders leave
out any row the model generated nothing into or that is longer than the context.

Hand-counted with the built-in byte-level tokenizer (one id per byte; ``<|im_start|>`` and the
eos ``<|im_end|>`` are one id each) and the compact tool template of the FrozenLake agent, as
in test_agent_segments.py:

* the first call with the 11-byte lake ``PFF/FHF/FFG``: 82 prompt ids (1 + 7 ``system\\n`` + 42
  tool line + 1 + 1 ``\\n`` + 1 + 5 ``user\\n`` + 11 + 1 + 1 + 1 + 10 ``assistant\\n``);
* the scripted answer: the 78-byte ``<tool_call>`` move + eos = 79 generated ids;
* a tool result of L bytes after it: 20 + L ids (``\\n`` + 1 + ``tool\\n`` + L + 1 + ``\\n`` + 1
  + ``assistant\\n``; the answer's eos closes the turn)."""

from __future__ import annotations

import json
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from roll_core.backends.infer import Completion
from roll_core.errors import RollError
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.models.loading import use_chat_template
from roll_core.rollout.agentic import (
    ChatFormat,
    TokenTrace,
    Trajectory,
    Turn,
    step_batch,
    trajectory_batch,
)
from roll_core.rollout.agentic.endpoint import (
    AgentEndpoint,
    AgentSession,
    EndpointError,
    chat_completion,
)
from tests.rollout.test_agent_segments import MOVE, TEMPLATE, TOOLS

LAKE = "PFF/FHF/FFG"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tokenizer = load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("m"))))
    use_chat_template(tokenizer, TEMPLATE)
    return tokenizer


def move(tok: Any, turn: int) -> Completion:
    ids = list(tok.encode(MOVE, add_special_tokens=False)) + [tok.eos_token_id]
    return Completion(turn, ids, [-(i + 1) / 100 for i in range(len(ids))], "stop", 0)


def new_session(tok: Any, generate: Any = None) -> AgentSession:
    def scripted(prompt: list[int], turn: int, vision: Any, params: Any = None) -> Completion:
        return move(tok, turn)

    traj = Trajectory("lake", 0, 0, 0)
    # max_context 512 with max_new_tokens 80: a prompt of at most 432 ids is served
    return AgentSession(traj, ChatFormat(tok), generate or scripted, 80, 512, "m")


def body(messages: list[Any]) -> dict[str, Any]:
    return {"model": "policy", "messages": messages, "tools": TOOLS}


def snapshot(s: AgentSession) -> tuple[Any, ...]:
    """The session's state, read under its lock (a reply is recorded right after it is
    delivered, before the session's next call is served)."""
    with s.lock:
        t = s.traj
        return (
            list(t.trace.ids),
            list(t.trace.mask),
            list(t.trace.log_probs),
            len(t.segments),
            [len(u.prompt_ids) for u in t.turns],
            list(s.messages),
            s.tools_key,
            s.after_eos,
        )


def test_a_refused_call_and_its_retries_leave_the_trajectory_as_it_was(tok: Any) -> None:
    s = new_session(tok)
    first = chat_completion(s, body([{"role": "user", "content": LAKE}]))
    answer = first["choices"][0]["message"]
    assert len(s.traj.trace.ids) == 82 + 79 and sum(s.traj.trace.mask) == 79
    before = snapshot(s)
    # a 300-byte tool result: 161 + 20 + 300 = 481 prompt ids, + 80 > 512: refused
    call_id = answer["tool_calls"][0]["id"]
    big = [
        {"role": "user", "content": LAKE},
        answer,
        {"role": "tool", "tool_call_id": call_id, "content": "x" * 300},
    ]
    for _ in range(4):  # the call, then the client's retries of it
        with pytest.raises(
            EndpointError, match=r"\(481 in the messages, 80 in the completion\)"
        ) as err:
            chat_completion(s, body(big))
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
        assert snapshot(s) == before
    # a retry that starts over with a 500-byte lake (a new segment of 71 + 500 = 571 ids)
    with pytest.raises(EndpointError, match=r"\(571 in the messages"):
        chat_completion(s, body([{"role": "user", "content": "y" * 500}]))
    assert snapshot(s) == before and s.context_full
    # the episode's one row: its 82 prompt ids and 79 generated ids, nothing of the refusals
    batch = trajectory_batch([[s.traj]], pad_id=tok.pad_token_id, max_len=512)
    assert batch.tensors["input_ids"].shape == (1, 161)
    assert batch.tensors["response_lengths"].tolist() == [79]
    assert batch.meta["rows_dropped_no_generated"] == batch.meta["rows_dropped_too_long"] == 0
    # an agent that shortens the result continues from the served conversation: 161 + 31 ids
    big[-1]["content"] = "SPF/FHF/FFG"
    chat_completion(s, body(big))
    assert snapshot(s)[4] == [82, 161 + 31]
    assert s.traj.turns[1].prompt_ids[:161] == before[0]


class Gate:
    """A model that generates only once the test lets it (after the client hung up)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.called = threading.Event()
        self.release = threading.Event()
        self.answered = threading.Event()

    def __call__(self, prompt: list[int], turn: int, vision: Any, params: Any = None) -> Completion:
        self.called.set()
        assert self.release.wait(20)
        self.answered.set()  # the call is served on under the session's lock (snapshot waits)
        return move(self.tok, turn)

    def reset(self) -> None:
        for event in (self.called, self.release, self.answered):
            event.clear()


def test_a_reply_the_client_never_received_is_not_trained(
    tok: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = AgentEndpoint(port=0)
    gate = Gate(tok)
    s = new_session(tok, gate)
    try:
        url = endpoint.open(s)
        gate.release.set()
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": LAKE}]
        answer = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        before = snapshot(s)
        assert len(before[0]) == 161
        # the next call: the client gives up (its timeout) while the model generates
        gate.reset()
        call_id = (answer.choices[0].message.tool_calls or [])[0].id
        messages += [
            answer.choices[0].message,
            {"role": "tool", "tool_call_id": call_id, "content": "SPF/FHF/FFG"},
        ]
        impatient = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert gate.called.is_set()
        gate.release.set()  # the model answers after the client hung up
        assert gate.answered.wait(20)
        assert snapshot(s) == before  # the reply no agent saw is not in the trajectory
        assert s.undelivered == 1
        # the retry is served as if it were the first try: 161 + 31 prompt ids
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        ids, mask, _, segments, prompts, *_ = snapshot(s)
        assert prompts == [82, 161 + 31] and segments == 0
        assert len(ids) == 161 + 31 + 79 and sum(mask) == 2 * 79
    finally:
        endpoint.close()
    assert "Traceback" not in capsys.readouterr().err


def test_a_client_that_resets_the_connection_has_nothing_recorded(
    tok: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = AgentEndpoint(port=0)
    gate = Gate(tok)
    s = new_session(tok, gate)
    try:
        endpoint.open(s)
        data = json.dumps(body([{"role": "user", "content": LAKE}])).encode()
        head = (
            f"POST /s/{s.token}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        sock = socket.create_connection(("127.0.0.1", endpoint.port))
        sock.sendall(head.encode() + data)
        assert gate.called.wait(20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # linger 0: a reset, as a killed agent process leaves it
        gate.release.set()
        assert gate.answered.wait(20)
        ids, _, _, segments, prompts, messages, *_ = snapshot(s)
        assert (ids, segments, prompts, messages) == ([], 0, [], [])
        assert s.undelivered == 1
    finally:
        endpoint.close()
    assert "Traceback" not in capsys.readouterr().err


# ---- the batch builders' last line of defence ---------------------------------------------------
def trace(n_prompt: int, n_generated: int) -> TokenTrace:
    t = TokenTrace()
    t.add_context(list(range(1, n_prompt + 1)))
    t.add_generated([7] * n_generated, [-0.5] * n_generated)
    return t


def turn(n_prompt: int, n_generated: int, segment: int = 0) -> Turn:
    return Turn(
        prompt_ids=[1] * n_prompt,
        response_ids=[7] * n_generated,
        log_probs=[-0.5] * n_generated,
        finish_reason="stop",
        policy_version=2,
        action="a",
        reward=1.0,
        state_key=f"s{n_prompt}",
        action_is_valid=True,
        gen_s=0.0,
        env_s=0.0,
        segment=segment,
    )


def test_rows_without_generated_tokens_or_past_the_context_are_not_trained() -> None:
    traj = Trajectory("t", 0, 0, 0, episode_return=1.0)
    # segment 0: a prompt alone (5 ids); segment 1: 6 + 4 = 10 ids > 8; segment 2: 4 + 2 ids
    traj.segments = [trace(5, 0), trace(6, 4)]
    traj.trace = trace(4, 2)
    traj.turns = [turn(6, 4, segment=1), turn(4, 2, segment=2)]
    other = Trajectory("t", 0, 1, 1, episode_return=0.0, trace=trace(3, 3))
    other.turns = [turn(3, 3)]
    batch = trajectory_batch([[traj, other]], pad_id=0, max_len=8)
    assert batch.tensors["input_ids"].shape == (2, 6)  # rows of 6 and 6 ids
    assert batch.tensors["response_lengths"].tolist() == [2, 3]
    assert batch.tensors["scores"].tolist() == [1.0, 0.0]
    assert batch.tensors["response_mask"].sum().item() == 5
    assert batch.meta["rows_dropped_no_generated"] == 1
    assert batch.meta["rows_dropped_too_long"] == 1
    # step-wise: a turn with no response, one of 6 + 4 ids, and a 3 + 2 one
    step = Trajectory("t", 0, 0, 0)
    step.turns = [turn(3, 0), turn(6, 4), turn(3, 2)]
    steps = step_batch([[step]], pad_id=0, max_len=8)
    assert steps.tensors["input_ids"].shape == (1, 5)
    assert steps.tensors["step_episode"].tolist() == [0]
    assert steps.meta["rows_dropped_no_generated"] == steps.meta["rows_dropped_too_long"] == 1
    # nothing left to train is a clear error, not an empty update
    empty = Trajectory("t", 0, 0, 0, trace=trace(9, 0))
    with pytest.raises(RollError, match="no row of this batch can be trained: 1 had no"):
        trajectory_batch([[empty]], pad_id=0, max_len=8)


def test_an_agent_whose_first_call_cannot_fit_is_a_fault_that_says_so(
    tok: Any, tmp_path: Path
) -> None:
    from roll_core.envs.agents import load_agent
    from roll_core.rollout.agentic.agent_episode import AgentFault, play_scripted

    path = tmp_path / "long_agent.py"
    path.write_text(
        "import openai\n"
        "def run(client, task):\n"
        "    try:\n"
        "        client.chat.completions.create(\n"
        "            model='policy', messages=[{'role': 'user', 'content': 'y' * 600}])\n"
        "    except openai.BadRequestError:\n"
        "        return 1.0\n"
    )
    endpoint = AgentEndpoint(port=0)
    try:
        with pytest.raises(AgentFault) as err:
            play_scripted(
                Trajectory("long", 0, 0, 0),
                load_agent(f"{path}:run"),
                lambda task, messages, prompt, turn: [tok.eos_token_id],
                endpoint=endpoint,
                chat=ChatFormat(tok),
                max_new_tokens=80,
                max_context=512,
                timeout=20.0,
            )
    finally:
        endpoint.close()
    # 1 + 5 `user\n` + 600 + 1 + 1 `\n` + 1 + 10 `assistant\n` = 619 prompt ids
    assert "its first call was refused (the conversation (619 tokens) plus max_tokens=80 " in (
        str(err.value)
    )
    assert "does not fit rollout.max_context=512), so the model generated nothing" in str(err.value)
