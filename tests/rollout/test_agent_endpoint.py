"""Bring your own agent: the OpenAI-compatible endpoint, with the official ``openai`` client
against it and a scripted inference cluster behind the rollout router.

The scripted model (``CalcInfer``) plays a good calculator agent: with no tool result in its
prompt it calls ``calc`` on the question, after a ``tool`` turn it answers with the result. Its
token ``i`` of a response has log-prob ``-(i + 1) / 100``, so the behaviour log-probs can be
checked token by token."""

from __future__ import annotations

import json
import re
import socket
import textwrap
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from roll_core.backends.infer import Completion, Request, SamplingParams
from roll_core.envs.agents import load_agent
from roll_core.errors import ConfigError
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.models.loading import use_chat_template
from roll_core.rollout.agentic import (
    ChatFormat,
    EnvSpec,
    RolloutSettings,
    Trajectory,
    env_producer,
    run_episodes,
    trajectory_batch,
)
from roll_core.rollout.agentic.endpoint import AgentEndpoint, AgentSession, check_port

ROOT = Path(__file__).resolve().parents[2]
AGENT = str(ROOT / "examples/agents/calculator_agent.py")
TEMPLATE = str(ROOT / "examples/agents/chatml-tools.jinja")
CALL = '<tool_call>\n{"name": "%s", "arguments": {"x": "%s"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tokenizer = load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("m"))))
    use_chat_template(tokenizer, TEMPLATE)
    return tokenizer


def reply(text: str) -> str:
    """The scripted model's answer to a prompt (its decoded text)."""
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
    if results:
        return results[-1]
    question = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text)[-1]
    tool = "python" if question == "1*1" else "calc"  # 1*1: a tool the agent did not declare
    return CALL % (tool, question)


def completion(tok: Any, request_id: int, prompt: list[int], version: int = 0) -> Completion:
    ids = tok.encode(reply(tok.decode(prompt)), add_special_tokens=False) + [tok.eos_token_id]
    logps = [-(i + 1) / 100 for i in range(len(ids))]
    return Completion(request_id, ids, logps, "stop", version)


class CalcInfer:
    """A stand-in actor_infer cluster (the surface the router uses) running the scripted model."""

    def __init__(self, tok: Any) -> None:
        self.world_size = 1
        self.tok = tok
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.requests: list[Request] = []

    def at(self, rank: int) -> CalcInfer:
        return self

    def generate_request(self, request: Request, params: SamplingParams) -> Future:
        self.requests.append(request)
        return self.pool.submit(completion, self.tok, request.request_id, request.prompt_ids)

    def abort_requests(self, request_ids: list[int]) -> Future:
        done: Future = Future()
        done.set_result(None)
        return done


def settings(**kw: Any) -> RolloutSettings:
    base: dict[str, Any] = dict(
        params=SamplingParams(max_new_tokens=80),
        group_size=1,
        max_context=512,
        step_timeout_s=5,
        episode_timeout_s=20,
    )
    return RolloutSettings(**(base | kw))


def play(
    tok: Any, agent: str, seeds: list[int], notes: list[str] | None = None, **kw: Any
) -> list[Trajectory]:
    """The episodes of ``seeds``; ``notes`` gets the fault texts the run's console shows."""
    spec = EnvSpec("calc", lambda: None, agent=load_agent(agent))
    mgr = env_producer(infer=CalcInfer(tok), tokenizer=tok, specs=[spec], settings=settings(**kw))
    try:
        return run_episodes(mgr, spec, seeds, SamplingParams(max_new_tokens=80))
    finally:
        if notes is not None:
            notes += mgr.members.take_fault_notes()
        mgr.close()


# ---- whole episodes through the router --------------------------------------------------------
def test_agent_episode_is_stitched_token_in_token_out(tok: Any) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "examples/agents"))
    from calculator_agent import TOOLS, make_task

    [traj] = play(tok, AGENT + ":run", [3])
    task = make_task(3)
    assert (traj.status, traj.success, traj.episode_return, traj.error) == ("done", True, 1.0, "")
    assert len(traj.turns) == 2 and traj.turns[-1].reward == 1.0
    chat = ChatFormat(tok)
    first = chat.prompt(
        [{"role": "system", "content": "Use calc."}, {"role": "user", "content": task["question"]}],
        TOOLS,
    )
    call = tok.encode(CALL % ("calc", task["question"]), add_special_tokens=False)
    eos = [tok.eos_token_id]
    result = str(task["answer"])
    tool_ids = tok.encode(f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n")
    answer = tok.encode(result, add_special_tokens=False)
    # exactly: first prompt, generated call + eos, the template's tool turn, generated answer
    assert traj.trace.ids == first + call + eos + tool_ids + answer + eos
    assert traj.trace.mask == [0] * len(first) + [1] * (len(call) + 1) + [0] * len(tool_ids) + [
        1
    ] * (len(answer) + 1)
    gen_logps = [lp for lp, m in zip(traj.trace.log_probs, traj.trace.mask, strict=True) if m]
    assert gen_logps == [-(i + 1) / 100 for i in range(len(call) + 1)] + [
        -(i + 1) / 100 for i in range(len(answer) + 1)
    ]
    assert traj.turns[1].prompt_ids == first + call + eos + tool_ids  # token-in
    batch = trajectory_batch([[traj]], pad_id=tok.pad_token_id)
    assert int(batch.tensors["response_lengths"][0]) == len(call) + len(answer) + 2


def test_agent_faults_carry_the_agents_own_error(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "agents.py"
    path.write_text(
        textwrap.dedent(
            """
            import time
            def crash(client, task):
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2*3"}])
                raise ValueError("my tool broke on " + str(task["seed"]))
            def silent(client, task):
                return 1.0
            def words(client, task):
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2*3"}])
                return "yes"
            def sleepy(client, task):
                time.sleep(5)
            def greedy(client, task):
                msgs = [{"role": "user", "content": "2*3"}]
                return client.chat.completions.create(model="policy", messages=msgs, n=2)
            """
        )
    )
    notes: list[str] = []
    [crash] = play(tok, f"{path}:crash", [7], notes)
    assert crash.status == "error" and "ValueError: my tool broke on" in crash.error
    assert "agents.py" in crash.error  # where in the agent's code
    # its text is shown on the run's console, not only counted
    assert notes == [f"validation episode of calc failed (error): {crash.error}"]
    [silent] = play(tok, f"{path}:silent", [0])
    assert silent.status == "error" and "without calling the model" in silent.error
    [words] = play(tok, f"{path}:words", [0])
    assert words.status == "error" and "must return the episode's reward as a number" in words.error
    [greedy] = play(tok, f"{path}:greedy", [0])  # the endpoint's 400, at the agent's line
    assert greedy.status == "error" and "BadRequestError" in greedy.error
    assert "n > 1 is not served" in greedy.error and "agents.py:15, in greedy" in greedy.error
    [sleepy] = play(tok, f"{path}:sleepy", [0], episode_timeout_s=0.5)
    assert sleepy.status == "timeout" and "episode_timeout_s" in sleepy.error


# ---- the endpoint with the openai client ------------------------------------------------------
def session(tok: Any, endpoint: AgentEndpoint, **kw: Any) -> tuple[AgentSession, openai.OpenAI]:
    def generate(prompt: list[int], turn: int, vision: Any, params: Any = None) -> Completion:
        return completion(tok, turn, prompt)

    s = AgentSession(
        Trajectory("calc", 0, 0, 0),
        ChatFormat(tok),
        generate,
        80,
        kw.get("ctx", 512),
        "m",
        history=kw.get("history", "segment"),
    )
    client = openai.OpenAI(base_url=endpoint.open(s), api_key="x", max_retries=0)
    return s, client


def served(s: AgentSession) -> Trajectory:
    """The session's trajectory once its last reply is recorded (a reply is recorded right
    after it reached the client, under the session's lock)."""
    with s.lock:
        return s.traj


def tools() -> list[dict[str, Any]]:
    import sys

    sys.path.insert(0, str(ROOT / "examples/agents"))
    from calculator_agent import TOOLS

    return TOOLS


def test_tool_calls_logprobs_and_models_round_trip(tok: Any) -> None:
    endpoint = AgentEndpoint(port=0, model="builtin:tiny-qwen3")
    try:
        s, client = session(tok, endpoint, history="strict")
        assert [m.id for m in client.models.list()] == ["builtin:tiny-qwen3"]
        messages: list[Any] = [{"role": "user", "content": "12*34"}]
        out = client.chat.completions.create(
            model="policy", messages=messages, tools=tools(), logprobs=True
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls or []
        assert call.function.name == "calc" and json.loads(call.function.arguments) == {
            "x": "12*34"
        }
        n = len(served(s).turns[0].response_ids)
        assert [t.logprob for t in choice.logprobs.content] == [-(i + 1) / 100 for i in range(n)]
        assert out.usage.completion_tokens == n
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "408"}]
        out = client.chat.completions.create(model="policy", messages=messages, tools=tools())
        assert out.choices[0].message.content == "408" and out.choices[0].finish_reason == "stop"
        assert (
            len(served(s).turns) == 2
            and s.traj.turns[1].prompt_ids[: len(s.traj.turns[0].prompt_ids)]
            == s.traj.turns[0].prompt_ids
        )
        # rewriting history is refused (rollout.agent_history: strict), naming the message
        bad = [
            {"role": "user", "content": "99*99"},
            *messages[1:],
            out.choices[0].message,
            {"role": "user", "content": "thanks"},
        ]
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\] differs"):
            client.chat.completions.create(model="policy", messages=bad, tools=tools())
        with pytest.raises(openai.BadRequestError, match="tools differ"):
            client.chat.completions.create(model="policy", messages=messages, tools=None)
        endpoint.close_session(s)
        with pytest.raises(openai.NotFoundError, match="no open episode session"):
            client.chat.completions.create(model="policy", messages=messages, tools=tools())
    finally:
        endpoint.close()


def test_undeclared_tool_and_bad_requests(tok: Any) -> None:
    endpoint = AgentEndpoint(port=0)
    try:
        s, client = session(tok, endpoint)
        out = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "1*1"}], tools=tools()
        )  # the model calls `python`, which the agent did not declare
        message = out.choices[0].message
        assert message.tool_calls is None and '"name": "python"' in (message.content or "")
        assert out.choices[0].finish_reason == "stop" and not served(s).turns[0].action_is_valid
        s2, client2 = session(tok, endpoint)
        bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
        with pytest.raises(openai.BadRequestError, match=r"tools\[0\] is not a valid tool"):
            client2.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "1"}], tools=bad_tool
            )
        s3, client3 = session(tok, endpoint, ctx=60)
        with pytest.raises(openai.BadRequestError, match="maximum context length is 60 tokens"):
            client3.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "1"}]
            )
        assert s3.context_full
    finally:
        endpoint.close()


# ---- bad input before a run -------------------------------------------------------------------
def test_bad_agent_modules_and_busy_port_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match="cannot import module 'no_such_agent_pkg.agent' for agent"
    ):
        load_agent("no_such_agent_pkg.agent:run")
    with pytest.raises(ConfigError, match="agent file 'missing.py' does not exist"):
        load_agent("missing.py:run")
    path = tmp_path / "a.py"
    path.write_text("def play(client, task):\n    return 0\ndef one(client):\n    return 0\n")
    with pytest.raises(ConfigError, match="has no function 'run'") as err:
        load_agent(str(path))
    assert "play" in (err.value.hint or "")
    with pytest.raises(ConfigError, match=r"cannot be called as one\(client, task\)"):
        load_agent(f"{path}:one")
    (tmp_path / "boom.py").write_text("raise RuntimeError('bad import')\n")
    with pytest.raises(ConfigError, match="raised RuntimeError: bad import"):
        load_agent(str(tmp_path / "boom.py"))
    assert load_agent(AGENT).is_async and load_agent(AGENT).task(1) == load_agent(AGENT).task(1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"endpoint_port={port}: the port is in use"):
            check_port(port)
        with pytest.raises(ConfigError, match="the port is in use"):
            AgentEndpoint(port=port)
    assert threading.active_count() >= 1
