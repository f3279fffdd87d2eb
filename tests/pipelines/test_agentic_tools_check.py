"""Start-up checks of envs with native tools (issue 28): tool schemas, a template without tool
support, and the template policy line, before a run directory exists."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from roll_core.config.agentic import AgenticConfig
from roll_core.envs import TextEnv, Transition
from roll_core.errors import ConfigError
from roll_core.pipelines.checks.agentic import check_chat_format, template_policy


class BadSchema(TextEnv):
    """A user env whose tool schema has a parameter of an unknown JSON type."""

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict]:
        return "go", {}

    def parse_action(self, text: str) -> str:
        return text

    def on_step(self, action: str) -> Transition:
        return Transition("done", 0.0, True)

    def render(self) -> str:
        return ""

    @property
    def tools(self) -> list[dict[str, Any]]:
        params = {"type": "object", "properties": {"n": {"type": "integr"}}}
        return [{"type": "function", "function": {"name": "count", "parameters": params}}]


def config(env: str, mode: str = "trajectory", **rollout: Any) -> AgenticConfig:
    return AgenticConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen3"},
            "envs": [{"env": env, "options": {}, "groups_per_step": 1}],
            "rollout": {"mode": mode, **rollout},
            "trainer": {"max_steps": 1},
        }
    )


def test_a_template_without_tool_support_is_a_recipe_error() -> None:
    with pytest.raises(ConfigError) as err:
        check_chat_format(config("tool_use"))  # builtin:tiny-qwen3: ChatML without tools
    assert err.value.message.startswith(
        "envs[0] (tool_use) declares tools (calculator, python), but the chat template of "
        "builtin:tiny-qwen3 has no tool support: it does not write the tool schemas into the "
        "prompt ('calculator', 'Evaluate an arithmetic expression.', 'expression', 'python' "
        "missing)"
    )
    assert "rollout.chat_template" in (err.value.hint or "")


def test_an_invalid_tool_schema_names_the_env_and_the_problem() -> None:
    with pytest.raises(ConfigError) as err:
        check_chat_format(config(f"{__name__}:BadSchema"))
    assert (
        "envs[0]" in err.value.message
        and "count: function.parameters is not valid JSON Schema" in err.value.message
    )
    assert "(checked with jsonschema)" in err.value.message


@pytest.mark.parametrize(("kind", "rewrites"), [("qwen2.5", False), ("qwen3", True)])
def test_a_tool_template_passes_and_the_log_names_rewrites(
    qwen_real, kind: str, rewrites: bool
) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen_real(f"tokenizer-{kind}")))
    chat = check_chat_format(config("tool_use"), tok)
    assert chat is not None and len(chat.shape_checks) == (6 if kind == "qwen3" else 4)
    line = template_policy(chat, "trajectory")
    assert (line is not None) == rewrites
