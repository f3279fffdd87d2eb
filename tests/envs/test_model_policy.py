"""The model policy of `roll debug-env`: chat prompts, context trimming, seeded sampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from roll_core.envs import TextEnv, Transition
from roll_core.envs.model_policy import ModelPolicy
from roll_core.envs.play import play_episode
from roll_core.errors import ModelError
from roll_core.models import materialize_builtin


class Counter(TextEnv):
    """Observations `at 0`, `at 1`, ...: four characters each."""

    instructions = "Count."

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict]:
        self.n = 0
        return "at 0", {}

    def parse_action(self, text: str) -> str:
        return text

    def on_step(self, action: str) -> Transition:
        self.n += 1
        return Transition(f"at {self.n % 10}", 0.0)

    def render(self) -> str:
        return f"at {self.n}"


@pytest.fixture(scope="module")
def loaded(cache_dir: Path) -> ModelPolicy:
    """builtin:tiny-qwen3 loaded once for this module."""
    return ModelPolicy(str(materialize_builtin("tiny-qwen3", cache_dir)))


@pytest.fixture
def policy(loaded: ModelPolicy) -> ModelPolicy:
    """The loaded policy with default settings (tests change them freely)."""
    loaded.max_new_tokens, loaded.temperature = 4, 0.0
    loaded.context = 512  # builtin:tiny-qwen3's max_position_embeddings
    return loaded


def test_prompt_is_the_chat_template_of_system_and_observation(policy: ModelPolicy) -> None:
    policy.start(Counter(), 0)
    policy.messages.append({"role": "user", "content": "at 0"})
    ids = policy._encode(policy.messages)
    # byte-level tokenizer, ChatML: <|im_start|> role \n content <|im_end|> \n per message
    # system: 1 + 6 + 1 + 6 + 1 + 1 = 16; user: 1 + 4 + 1 + 4 + 1 + 1 = 12;
    # generation prompt <|im_start|>assistant\n: 1 + 9 + 1 = 11; total 39
    assert len(ids) == 39
    assert policy.tokenizer.decode(ids) == (
        "<|im_start|>system\nCount.<|im_end|>\n<|im_start|>user\nat 0<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_old_turns_are_dropped_to_fit_the_context(policy: ModelPolicy) -> None:
    policy.context = 90  # room for the 39-token start plus about one more turn
    episode = play_episode(Counter(max_steps=4), policy, seed=0)
    infos = [t.policy_info for t in episode.turns]
    assert infos[0]["prompt_tokens"] == 39 and infos[0]["dropped_turns"] == 0
    assert all(i["prompt_tokens"] <= 90 - 4 for i in infos)
    assert infos[-1]["dropped_turns"] > 0
    assert all(i["response_tokens"] <= 4 for i in infos)

    policy.context = 30  # not even the system prompt and the first observation (39 tokens)
    with pytest.raises(ModelError, match="take 39 tokens, but .* has a context of 30 tokens"):
        play_episode(Counter(), policy, seed=0)


def test_sampling_is_seeded_by_episode(policy: ModelPolicy) -> None:
    policy.temperature, policy.max_new_tokens = 1.0, 6
    runs = [
        [t.response for t in play_episode(Counter(max_steps=2), policy, seed=s).turns]
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_tools_need_a_template_with_tool_support(policy: ModelPolicy) -> None:
    from roll_core.envs import make_env
    from tests.qwen_real import TEMPLATES

    env = make_env("tool_use", task="arithmetic")
    with pytest.raises(ModelError, match=r"declares tools \(calculator, python\).*no tool support"):
        policy.start(env, 0)  # the built-in ChatML template ignores tools=
    saved = policy.tokenizer.chat_template
    policy.tokenizer.chat_template = TEMPLATES["qwen2.5"].read_text()
    policy.context = 2048  # the schemas take ~1,000 ids of the byte-level tiny vocabulary
    try:
        policy.start(env, 0)
        obs, _ = env.reset(0)
        policy.act(obs)
        text = policy.tokenizer.decode(policy._encode(policy.messages[:2]))
        assert '"name": "calculator"' in text and "<tools>" in text  # the schemas are rendered
        step = env.step(
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
        )
        policy.act(step.observation)
        assert policy.messages[-2] == {"role": "tool", "name": "calculator", "content": "2"}
    finally:
        policy.tokenizer.chat_template = saved
