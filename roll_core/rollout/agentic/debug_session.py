"""The session behind ``roll debug-env agent:path.py:run``: an agent program's episodes played
through the endpoint, its model calls answered by a model (``--policy model``) or by the
module's expert (``--policy expert``), outside training (one process, no Ray).

The command line prints each episode (``roll_cli/debug_env.py``); env episodes have their own
session, :class:`roll_core.envs.debug_session.DebugSession`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from roll_core.envs.agents import AgentProgram, check_task, load_agent
from roll_core.rollout.agentic.agent_episode import Respond, expert_responder, play_scripted
from roll_core.rollout.agentic.chat import ChatFormat
from roll_core.rollout.agentic.endpoint import AgentEndpoint
from roll_core.rollout.agentic.episode import Trajectory

EPISODE_TIMEOUT_S = 600.0

# (trajectory, episode index from 0, the task the program was given)
OnEpisode = Callable[[Trajectory, int, Any], None]


def tokens_of(model: str) -> tuple[Any, int]:
    """A model's tokenizer and context length, without loading its weights."""
    from roll_core.models import load_tokenizer
    from roll_core.models.loading import model_config

    return load_tokenizer(model), int(model_config(model).get("max_position_embeddings") or 4096)


def builtin_chatml_tokens() -> tuple[Any, int]:
    """The built-in models' ChatML tokenizer and a 4096-token context: the expert writes
    text, shown in these tokens when no --model is given."""
    import tempfile

    from roll_core.models import load_tokenizer, materialize_builtin

    where = tempfile.mkdtemp(prefix="roll-debug-agent-")
    return load_tokenizer(str(materialize_builtin("tiny-qwen3", Path(where)))), 4096


class AgentDebugSession:
    """An agent program (``path`` = ``path/to/agent.py:run``) with its ``options``, answered
    by ``model`` or, with ``expert`` (or no model), by the module's expert, whose text is then
    shown in ``model``'s tokenizer and context when one is given."""

    def __init__(
        self,
        path: str,
        options: dict[str, Any],
        *,
        model: str | None,
        chat_template: Path | None,
        max_new_tokens: int,
        temperature: float,
        expert: bool = False,
    ) -> None:
        self.path = path
        self.max_new_tokens = max_new_tokens
        self.program: AgentProgram = load_agent(path, options)
        self.player: Any = None
        self.model: str | None = None if expert else model
        if model is not None and expert:  # the expert's text in the model's tokens and context
            self.tokenizer, self.context = tokens_of(model)
        elif model is not None:
            from roll_core.envs.model_policy import ModelPolicy

            self.player = ModelPolicy(model, max_new_tokens=max_new_tokens, temperature=temperature)
            self.tokenizer, self.context = self.player.tokenizer, self.player.context
        else:
            self.tokenizer, self.context = builtin_chatml_tokens()
        if chat_template is not None:
            from roll_core.models.loading import use_chat_template

            use_chat_template(self.tokenizer, str(chat_template))
        self.chat = ChatFormat(self.tokenizer)
        self.respond: Respond = self._model_respond if self.player else self._expert_respond()

    def _model_respond(
        self, task: Any, messages: list[Any], prompt: list[int], turn: int
    ) -> list[int]:
        ids: list[int] = self.player.generate_ids(prompt, turn)[0]
        return ids

    def _expert_respond(self) -> Respond:
        return expert_responder(self.program, self.chat)

    def run(self, seed: int, episodes: int, on_episode: OnEpisode) -> None:
        """Play ``episodes`` episodes (seeds ``seed``, ``seed + 1``, ...), each handed to
        ``on_episode`` as it ends; the endpoint is closed at the end."""
        if self.player is not None:
            self.player._seed = seed
        endpoint = AgentEndpoint(port=0, model=self.model or "expert")
        try:
            for i in range(episodes):
                traj, task = self.play_one(endpoint, i, seed + i)
                on_episode(traj, i, task)
        finally:
            endpoint.close()

    def play_one(self, endpoint: AgentEndpoint, index: int, seed: int) -> tuple[Trajectory, Any]:
        """One episode: the program's task for ``seed`` and the trajectory it played (an
        error it raised ends the episode, recorded as such, like in training)."""
        if self.player is not None:
            self.player._seed = seed
        traj = Trajectory(tag=self.path, group=index, seed=seed, index=0)
        task = check_task(self.program, seed, timeout=EPISODE_TIMEOUT_S)  # its error, as such
        try:
            play_scripted(
                traj,
                self.program,
                self.respond,
                endpoint=endpoint,
                chat=self.chat,
                max_new_tokens=self.max_new_tokens,
                max_context=self.context,
                timeout=EPISODE_TIMEOUT_S,
            )
        except Exception as err:  # noqa: BLE001 - shown as the episode's end, like training
            from roll_core.envs.faults import describe_fault

            traj.status, traj.error = "error", describe_fault(err)
        return traj, task
