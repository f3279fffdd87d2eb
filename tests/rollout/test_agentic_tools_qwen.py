"""Token-in/token-out for tool conversations with the real Qwen vocabulary and the public
Qwen2.5 / Qwen3 chat templates (tests/qwen_real.py): the tool-use env's episode, played by the
real episode loop with scripted generations, is traced turn by turn as the first prompt (system
with the tool schemas + the problem), then per turn the generated ids and the template's ids for
the tool results (``tool`` messages) or the env's reply."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from roll_core.backends.infer import Completion, SamplingParams
from roll_core.envs import make_env
from roll_core.envs.sandbox import calculate
from roll_core.rollout.agentic import ChatFormat, EnvSpec, RolloutSettings, Trajectory, play_episode

SEED = 11
SYSTEM_Q25 = (
    "<|im_start|>system\n{system}\n\n# Tools\n\n"  # how Qwen2.5 opens a system turn with tools
)
TOOL_REPLY = "<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tokenizer(qwen_real: Callable[[str], Path], kind: str) -> Any:
    return AutoTokenizer.from_pretrained(str(qwen_real(f"tokenizer-{kind}")))


def env() -> Any:
    return make_env("tool_use", task="arithmetic", max_steps=4)


def script(expression: str, value: str, reasoning: bool) -> list[str]:
    think = "<think>\nI will use the tools.\n</think>\n\n" if reasoning else ""
    return [
        think + call("calculator", expression=expression),
        call("calculator", expression="6 * 7") + "\n" + call("python", code="print(2 ** 10)"),
        '<tool_call>{"name": "calc", "arguments": {}}</tool_call>',  # unknown tool: invalid
        f"<answer>{value}</answer>",
    ]


def play(tok: Any, responses: list[str], mode: str = "trajectory") -> Trajectory:
    chat = ChatFormat(tok)
    settings = RolloutSettings(
        params=SamplingParams(max_new_tokens=64), mode=mode, history_window=4, max_context=8192
    )
    generated = iter(responses)

    def generate(prompt: list[int], turn: int, vision: Any) -> Completion:
        ids = tok.encode(next(generated), add_special_tokens=False) + [tok.eos_token_id]
        return Completion(turn, ids, [-0.5] * len(ids), "stop", 0)

    traj = Trajectory("tools", 0, SEED, 0)
    return play_episode(
        traj,
        EnvSpec("tools", env),
        chat=chat,
        settings=settings,
        max_new_tokens=64,
        generate=generate,
        env_call=lambda fn, *a: fn(*a),
    )


@pytest.mark.parametrize("kind", ["qwen2.5", "qwen3"])
def test_tool_episode_ids_are_generated_plus_template_ids(qwen_real, kind: str) -> None:
    tok = tokenizer(qwen_real, kind)
    replay = env()
    obs, _ = replay.reset(SEED)
    expression = re.fullmatch(r"Problem: Compute (.+)\.", obs).group(1)  # type: ignore[union-attr]
    value = calculate(expression)
    responses = script(expression, value, reasoning=kind == "qwen3")
    traj = play(tok, responses)
    assert traj.status == "done" and traj.success and len(traj.turns) == 4

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    messages = [
        {"role": "system", "content": replay.system_prompt},
        {"role": "user", "content": obs},
    ]
    first = tok.apply_chat_template(
        messages, tools=replay.tools, add_generation_prompt=True, tokenize=False
    )
    assert '"name": "calculator"' in first and '"name": "python"' in first  # the schemas
    if kind == "qwen2.5":
        assert first.startswith(SYSTEM_Q25.format(system=replay.system_prompt))
    expected = enc(first)
    replies = [
        TOOL_REPLY.format(body=f"<tool_response>\n{value}\n</tool_response>"),
        TOOL_REPLY.format(
            body="<tool_response>\n42\n</tool_response>\n<tool_response>\n1024\n</tool_response>"
        ),
        None,  # the invalid call: a user message, checked below
    ]
    for k, turn in enumerate(traj.turns):
        assert turn.prompt_ids == expected, f"turn {k}"  # the model saw exactly the trace so far
        assert turn.response_ids == enc(responses[k]) + [tok.eos_token_id]
        expected = expected + turn.response_ids
        step = replay.step(responses[k])
        if k == 2:
            assert not step.info["action_is_valid"]
            reply = TOOL_REPLY.replace("user\n{body}", "user\n" + step.observation)
            replies[2] = reply
        if k < 3:
            expected += enc(replies[k])[1:]  # <|im_end|> was generated
    assert traj.trace.ids == expected
    assert sum(traj.trace.mask) == sum(len(t.response_ids) for t in traj.turns)
    # Every id the env or the template wrote is masked; the generated ones are not.
    assert all(m == 0 for m in traj.trace.mask[: len(enc(first))])


@pytest.mark.parametrize("kind", ["qwen2.5", "qwen3"])
def test_the_tool_trace_equals_the_templates_full_rendering(qwen_real, kind: str) -> None:
    """Where the template does not rewrite history (both, for tool turns), the trace is the
    template's own rendering of the whole conversation with structured tool calls."""
    tok = tokenizer(qwen_real, kind)
    replay = env()
    obs, _ = replay.reset(SEED)
    responses = [call("calculator", expression="6 * 7"), call("python", code="print(6 * 7)")]
    traj = play(tok, [*responses, "<answer>1</answer>"])
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": replay.system_prompt},
        {"role": "user", "content": obs},
    ]
    for text in responses:
        data = json.loads(text.split("\n")[1])
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": data}],
            }
        )
        messages.append({"role": "tool", "name": data["name"], "content": "42"})
    full = tok.apply_chat_template(
        messages, tools=replay.tools, add_generation_prompt=True, tokenize=False
    )
    prefix = traj.trace.ids[: len(traj.trace.ids) - len(traj.turns[-1].response_ids)]
    assert prefix == tok.encode(full, add_special_tokens=False)


@pytest.mark.parametrize("kind", ["qwen2.5", "qwen3"])
def test_shape_checks_find_the_rewritten_history(qwen_real, kind: str) -> None:
    chat = ChatFormat(tokenizer(qwen_real, kind))
    checks = {c.shape: c for c in chat.check_shapes(env().tools)}
    unstable = sorted(shape for shape, c in checks.items() if not c.stable)
    if kind == "qwen2.5":
        assert len(checks) == 4 and unstable == []
    else:  # Qwen3 drops the reasoning of turns before the last user turn, keeps it in tool turns
        assert len(checks) == 6
        assert unstable == ["assistant with reasoning, then a user turn"]
        detail = checks[unstable[0]].detail
        assert "assistant\\n42<|im_end|>" in detail and "<think>" in detail
        assert checks["assistant with reasoning and a tool call, then its tool result"].stable


def test_template_policy_names_the_shapes(qwen_real) -> None:
    from roll_core.pipelines.checks.agentic import template_policy

    chat = ChatFormat(tokenizer(qwen_real, "qwen3"))
    chat.check_shapes(env().tools)
    line = template_policy(chat, "trajectory")
    assert line is not None and "(assistant with reasoning, then a user turn)" in line
    assert "never re-rendered" in line and template_policy(chat, "step") is None
    q25 = ChatFormat(tokenizer(qwen_real, "qwen2.5"))
    q25.check_shapes(env().tools)
    assert template_policy(q25, "trajectory") is None


def test_step_mode_prompts_render_tool_messages(qwen_real) -> None:
    tok = tokenizer(qwen_real, "qwen2.5")
    traj = play(tok, [call("calculator", expression="6 * 7"), "<answer>1</answer>"], mode="step")
    second = tok.decode(traj.turns[1].prompt_ids)
    assert second.endswith(
        "<|im_start|>assistant\n" + call("calculator", expression="6 * 7") + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_every_turn_is_trained_in_the_context_it_was_generated_in(qwen_real, fp32_trainer) -> None:
    """A random-init Qwen3 with the real vocabulary: the log-probs of each turn's generated ids
    in the trajectory row (tool messages between turns) equal those under that turn's own
    prompt, turn by turn."""
    import torch

    from roll_core.rollout.agentic import step_batch, trajectory_batch

    trainer = fp32_trainer(str(qwen_real("qwen3")))
    tok = trainer.tokenizer
    obs, _ = env().reset(SEED)
    expression = re.fullmatch(r"Problem: Compute (.+)\.", obs).group(1)  # type: ignore[union-attr]
    traj = play(tok, script(expression, calculate(expression), reasoning=True))
    assert len(traj.turns) == 4
    rows, whole = (
        step_batch([[traj]], pad_id=tok.pad_token_id),
        trajectory_batch([[traj]], pad_id=tok.pad_token_id),
    )
    per_turn, in_trace = trainer.log_probs(rows), trainer.log_probs(whole)
    turn_mask, trace_mask = (
        rows.tensors["response_mask"].bool(),
        whole.tensors["response_mask"].bool(),
    )
    for k, turn in enumerate(traj.turns):
        assert int(turn_mask[k].sum()) == len(turn.response_ids)
    expected = torch.cat([per_turn[k][turn_mask[k]] for k in range(len(traj.turns))])
    got = in_trace[0][trace_mask[0]]
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) < 2e-4
