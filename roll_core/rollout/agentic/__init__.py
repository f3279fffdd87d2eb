"""Environment-level asynchronous rollout for multi-turn agentic RL (see :mod:`.episodes`).

* :mod:`.episodes`: :class:`EpisodeMembers`, a group's episodes on threads, and
  :func:`env_producer`, the rollout producer (rollout/producer.py) of env groups;
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
from roll_core.rollout.agentic.episodes import EpisodeMembers, env_producer, run_episodes

__all__ = [
    "ChatFormat",
    "EnvSpec",
    "EpisodeCancelled",
    "EpisodeMembers",
    "RolloutSettings",
    "TokenTrace",
    "Trajectory",
    "Turn",
    "env_producer",
    "episode_metrics",
    "first_messages",
    "play_episode",
    "run_episodes",
    "step_batch",
    "trajectory_batch",
    "window_prompt",
]
