"""Environment-level asynchronous rollout for multi-turn agentic RL (see :mod:`.manager`).

* :mod:`.manager`: :class:`EnvRolloutManager`, which schedules groups of episodes;
* :mod:`.episode`: one episode's loop (:func:`play_episode`) and what it records;
* the generation requests go through the shared router (:mod:`roll_core.rollout.router`);
* :mod:`.batch`: trajectories -> the training batch (trajectory or step mode);
* :mod:`.chat`: the chat template applied incrementally (token-in, token-out).
"""

from roll_core.rollout.agentic.batch import episode_metrics, step_batch, trajectory_batch
from roll_core.rollout.agentic.chat import ChatFormat, TokenTrace, first_messages
from roll_core.rollout.agentic.episode import (
    EnvSpec,
    EpisodeCancelled,
    RolloutSettings,
    Trajectory,
    Turn,
    play_episode,
    window_prompt,
)
from roll_core.rollout.agentic.manager import AgenticResult, EnvRolloutManager

__all__ = [
    "AgenticResult",
    "ChatFormat",
    "EnvRolloutManager",
    "EnvSpec",
    "EpisodeCancelled",
    "RolloutSettings",
    "TokenTrace",
    "Trajectory",
    "Turn",
    "episode_metrics",
    "first_messages",
    "play_episode",
    "step_batch",
    "trajectory_batch",
    "window_prompt",
]
