"""Agentic token-in/token-out with the real Qwen vocabulary and the public Qwen2.5 / Qwen3 chat
templates (tests/qwen_real.py). Qwen3's template is not prefix-stable (an empty
``<think>\\n\\n</think>\\n\\n`` in the last assistant turn, dropped once a user turn follows), so the
trace must never be re-rendered: the trained ids are the first prompt, then per turn the generated
ids and the template's ids for the env's reply."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from roll_core.backends.infer import SamplingParams
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.engine import Cluster
from roll_core.envs import FrozenLakeEnv
from roll_core.errors import ModelError
from roll_core.rollout.agentic import (
    ChatFormat,
    EnvSpec,
    RolloutSettings,
    env_producer,
    step_batch,
    trajectory_batch,
)

SYSTEM = "Lake."
REPLY = "<|im_end|>\n<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"


def tokenizer(qwen_real: Callable[[str], Path], kind: str) -> Any:
    return AutoTokenizer.from_pretrained(str(qwen_real(kind)))


@pytest.mark.parametrize("kind", ["tokenizer-qwen3", "tokenizer-qwen2.5"])
def test_chat_format_real_qwen_templates(qwen_real, kind: str) -> None:
    tok = tokenizer(qwen_real, kind)
    chat = ChatFormat(tok)
    assert chat.can_append and chat.renders_history
    assert chat.prefix_stable == (kind == "tokenizer-qwen2.5")  # Qwen3 rewrites history
    ids = tok.encode(REPLY.format(obs="You see a hole."), add_special_tokens=False)
    assert chat.env_message("You see a hole.", after_eos=False) == ids
    assert chat.env_message("You see a hole.", after_eos=True) == ids[1:]  # <|im_end|> generated
    assert ids[0] == tok.eos_token_id == 151645


def test_chat_format_template_that_drops_assistant_text(qwen_real) -> None:
    tok = tokenizer(qwen_real, "tokenizer-qwen3")
    tok.chat_template = (  # writes only user turns: no reply can follow generated ids
        "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}"
        "<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatFormat(tok)
    assert not chat.can_append and chat.renders_history
    assert "earlier assistant message" in str(chat.append_error)
    with pytest.raises(ModelError, match="turn by turn"):
        chat.env_message("x", after_eos=False)
    assert chat.prompt([{"role": "user", "content": "go"}]) == tok.encode(
        "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )


def env() -> FrozenLakeEnv:
    return FrozenLakeEnv(map="SFF/FHF/FFG", max_steps=3)  # random actions: 3 turns


def rollout(infer: Cluster, tok: Any, mode: str) -> list:
    settings = RolloutSettings(
        params=SamplingParams(max_new_tokens=5, temperature=1.0),
        group_size=2,
        mode=mode,
        history_window=1,
        max_context=4096,
    )
    mgr = env_producer(
        infer=infer, tokenizer=tok, specs=[EnvSpec("lake", env, SYSTEM, 1)], settings=settings
    )
    try:
        return mgr.next_batch(1).groups
    finally:
        mgr.close()


@pytest.fixture(scope="module")
def qwen3_model(qwen_real) -> str:
    return str(qwen_real("qwen3"))


def test_qwen3_trajectory_ids_are_generated_plus_template_reply_ids(
    qwen3_model: str,
    hf_infer: Callable[[str], Cluster],
    fp32_trainer: Callable[[str], TorchTrainBackend],
) -> None:
    trainer = fp32_trainer(qwen3_model)
    tok = trainer.tokenizer
    groups = rollout(hf_infer(qwen3_model), tok, "trajectory")
    for traj in groups[0]:
        assert len(traj.turns) == 3
        replay = env()
        obs, _ = replay.reset(traj.seed)
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": obs}]
        expected = tok.encode(
            tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for k, turn in enumerate(traj.turns):
            assert turn.prompt_ids == expected  # the model saw exactly the trace so far
            expected += turn.response_ids
            obs, *_ = replay.step(tok.decode(turn.response_ids, skip_special_tokens=True))
            if k < len(traj.turns) - 1:
                reply = tok.encode(REPLY.format(obs=obs), add_special_tokens=False)
                expected += reply[1:] if turn.response_ids[-1] == tok.eos_token_id else reply
        assert traj.trace.ids == expected
    batch = trajectory_batch(groups, pad_id=tok.pad_token_id)
    mask = batch.tensors["response_mask"]
    gap = ((trainer.log_probs(batch) - batch.tensors["behaviour_log_probs"]).abs() * mask).max()
    assert mask.sum() >= 2 * 3 and float(gap) < 2e-4


def test_qwen3_step_rows_with_history(
    qwen3_model: str,
    hf_infer: Callable[[str], Cluster],
    fp32_trainer: Callable[[str], TorchTrainBackend],
) -> None:
    trainer = fp32_trainer(qwen3_model)
    tok = trainer.tokenizer
    groups = rollout(hf_infer(qwen3_model), tok, "step")
    turns = [t for traj in groups[0] for t in traj.turns]
    batch = step_batch(groups, pad_id=tok.pad_token_id)
    assert len(batch) == len(turns) == 6
    for row, turn in enumerate(turns):
        n = len(turn.prompt_ids) + len(turn.response_ids)
        assert batch.tensors["input_ids"][row, :n].tolist() == turn.prompt_ids + turn.response_ids
    mask = batch.tensors["response_mask"]
    gap = ((trainer.log_probs(batch) - batch.tensors["behaviour_log_probs"]).abs() * mask).max()
    assert float(gap) < 2e-4
