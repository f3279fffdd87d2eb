"""Token-in/token-out on the real hf backend (tiny random model, fp32, local executor).

For a multi-turn episode, the ids handed to training must be exactly: the chat-template prompt
of (system, first observation), then per turn the generated ids and the tokenised env reply;
and the trainer's recomputed log-probs on them must match the generation's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from roll_core.backends.infer import SamplingParams
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.engine import Cluster
from roll_core.envs import FrozenLakeEnv
from roll_core.models import materialize_builtin
from roll_core.rollout.agentic import (
    EnvSpec,
    RolloutSettings,
    env_producer,
    step_batch,
    trajectory_batch,
)

SYSTEM = "Lake."
MAP = "SFF/FHF/FFG"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def infer(model_path: str, hf_infer: Callable[[str], Cluster]) -> Cluster:
    return hf_infer(model_path)


@pytest.fixture(scope="module")
def trainer(model_path: str, fp32_trainer: Callable[[str], TorchTrainBackend]) -> TorchTrainBackend:
    return fp32_trainer(model_path)


def env() -> FrozenLakeEnv:
    # a random model rarely names a move: invalid actions keep the episode going to max_steps
    return FrozenLakeEnv(map=MAP, max_steps=3)


def rollout(infer: Cluster, tokenizer: Any, mode: str) -> list:
    settings = RolloutSettings(
        params=SamplingParams(max_new_tokens=5, temperature=1.0),
        group_size=2,
        mode=mode,
        history_window=1,
        max_context=4096,
    )
    mgr = env_producer(
        infer=infer, tokenizer=tokenizer, specs=[EnvSpec("lake", env, SYSTEM, 1)], settings=settings
    )
    try:
        return mgr.next_batch(1).groups
    finally:
        mgr.close()


def chatml(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_trained_ids_are_generated_ids_plus_env_message_ids(
    infer: Cluster, trainer: TorchTrainBackend
) -> None:
    tok = trainer.tokenizer
    groups = rollout(infer, tok, "trajectory")
    eos = tok.eos_token_id
    for traj in groups[0]:
        assert len(traj.turns) == 3
        # rebuild independently: the template's first prompt, then generated ids and env replies
        replay = env()
        obs, _ = replay.reset(traj.seed)
        expected = list(
            tok.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": obs}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        generated_positions = []
        for k, turn in enumerate(traj.turns):
            assert turn.prompt_ids == expected  # generation saw exactly the trace so far
            generated_positions += range(len(expected), len(expected) + len(turn.response_ids))
            expected += turn.response_ids
            obs, *_ = replay.step(tok.decode(turn.response_ids, skip_special_tokens=True))
            if k < len(traj.turns) - 1:
                close = "\n" if turn.response_ids[-1:] == [eos] else "<|im_end|>\n"
                expected += chatml(
                    tok, f"{close}<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"
                )
        assert traj.trace.ids == expected
        assert [i for i, m in enumerate(traj.trace.mask) if m] == generated_positions

    batch = trajectory_batch(groups, pad_id=tok.pad_token_id)
    recomputed = trainer.log_probs(batch)
    mask = batch.tensors["response_mask"]
    gap = ((recomputed - batch.tensors["behaviour_log_probs"]).abs() * mask).max()
    assert mask.sum() >= 2 * 3  # at least one generated token per turn
    assert float(gap) < 2e-4
    # and the behaviour log-probs are not trivially zero
    assert float((batch.tensors["behaviour_log_probs"] * mask).abs().sum()) > 1.0


def test_step_rows_are_prompt_plus_generated_ids_with_matching_log_probs(
    infer: Cluster, trainer: TorchTrainBackend
) -> None:
    tok = trainer.tokenizer
    groups = rollout(infer, tok, "step")
    batch = step_batch(groups, pad_id=tok.pad_token_id)
    turns = [t for traj in groups[0] for t in traj.turns]
    assert len(batch) == len(turns) == 6
    for row, turn in enumerate(turns):
        n = len(turn.prompt_ids) + len(turn.response_ids)
        assert batch.tensors["input_ids"][row, :n].tolist() == turn.prompt_ids + turn.response_ids
    recomputed = trainer.log_probs(batch)
    mask = batch.tensors["response_mask"]
    gap = ((recomputed - batch.tensors["behaviour_log_probs"]).abs() * mask).max()
    assert float(gap) < 2e-4
    # the prompt of turn k > 0 holds at most one earlier turn (history_window = 1)
    assert all(
        torch.tensor(t.prompt_ids).eq(tok.convert_tokens_to_ids("<|im_start|>")).sum() <= 5
        for t in turns
    )
