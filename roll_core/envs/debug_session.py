"""The session behind ``roll debug-env ENV``: which env, which options, who plays, which seeds,
and the loop over the episodes (recording or replaying them).

The command line (``roll_cli/debug_env.py``) parses arguments, reads a human's keys and prints
each turn; everything else is here, in small steps it calls in order::

    session = DebugSession(env, ["width=7"])          # the env class (unknown: UsageError)
    session.validate_options()                         # name=value checked against the env
    chosen = choose_policy(policy, model, replay, record, interactive=sys.stdin.isatty())
    session.plan(seed=0, episodes=3, replay=None)      # seeds, or the recording's episodes
    player = session.make_policy(chosen, model=...)    # random, expert or model (None: replay)
    played = session.run(player, view, record=path, model=None, stop_on_abort=False)

Agent programs (``agent:path.py:run``) have their own session, beside the endpoint they call:
:class:`roll_core.rollout.agentic.debug_session.AgentDebugSession`.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any, Protocol

from roll_core.envs.base import TextEnv
from roll_core.envs.play import (
    Episode,
    ExpertPolicy,
    Policy,
    RandomPolicy,
    ReplayPolicy,
    Turn,
    check_replay,
    play_episode,
    read_episodes,
    summarize,
    write_episode,
)
from roll_core.envs.registry import (
    describe_options,
    env_id,
    get_env_class,
    parse_option_args,
    validate_options,
)
from roll_core.errors import UsageError


class EpisodeView(Protocol):
    """What shows the episodes as they are played (the terminal printer of the CLI)."""

    def begin(self, index: int, options: dict[str, Any]) -> None:
        """Episode ``index`` (from 0) of an env with ``options`` is about to start."""

    def start(self, episode: Episode) -> None:
        """The env was reset: ``episode`` has its system prompt and first observation."""

    def prompt(self, number: int, observation: str) -> None:
        """Turn ``number`` (from 1): the observation the policy is about to answer."""

    def turn(self, number: int, turn: Turn) -> None:
        """Turn ``number`` was played."""

    def end(self, episode: Episode) -> None:
        """The episode ended (or the player quit)."""


def choose_policy(
    policy: str | None,
    model: str | None,
    replay: Path | None,
    record: Path | None,
    *,
    interactive: bool,
    agent: bool = False,
) -> str:
    """Who plays: ``policy`` checked against the other options, or chosen when not given
    (``model`` with --model, ``human`` when stdin is a terminal, ``replay`` with --replay)."""
    if replay is not None:
        if policy is not None or model is not None or record is not None:
            raise UsageError(
                "--replay plays the recorded responses; it takes no --policy, --model or --record.",
                hint="Drop those options, or drop --replay to play new episodes.",
            )
        return "replay"
    if policy is None:
        if model is not None:
            return "model"
        if interactive:
            return "human"
        raise UsageError(
            "no --policy given and stdin is not a terminal, so nobody can play by hand.",
            hint="Choose a policy: --policy random, --policy model --model PATH (e.g. "
            "builtin:tiny-qwen3), --replay FILE, or --policy human to read actions from stdin, "
            "one per line.",
        )
    if policy == "model" and model is None:
        raise UsageError(
            "--policy model needs --model.",
            hint="Give a local HF model directory, a hub id or a built-in model, e.g. "
            "--model builtin:tiny-qwen3.",
        )
    if agent and policy == "expert":
        return policy  # --model: the tokenizer and context of the expert's text
    if policy != "model" and model is not None:
        raise UsageError(
            f"--model is only used with --policy model (the policy is {policy}).",
            hint="Drop --model, or use --policy model.",
        )
    return policy


def open_record(path: Path | None) -> IO[str] | None:
    """The recording file opened for writing (None without --record)."""
    if path is None:
        return None
    try:
        return path.open("w", encoding="utf-8")
    except OSError as err:
        raise UsageError(
            f"cannot write the recording {path}: {err.strerror}.",
            hint="Give --record a file in a directory that exists and is writable.",
        ) from None


class DebugSession:
    """Episodes of one env played outside training: one process, no Ray.

    ``env`` is a registered env name, ``gem:ID`` or ``package.module:Class``; ``option_args``
    its ``name=value`` options as typed. Call :meth:`validate_options`, :meth:`plan`, then
    :meth:`run` (:meth:`option_rows` instead, to list the env's options).
    """

    def __init__(self, env: str, option_args: list[str]) -> None:
        self.env_arg = env
        self.env_class: type[TextEnv] = get_env_class(env)
        self.name = env_id(self.env_class)
        self.option_args = option_args
        self.kwargs: dict[str, Any] = {}
        self.seeds: list[int] = []
        self.recorded: list[Episode] = []
        self.replay: Path | None = None
        self.env: TextEnv | None = None

    def option_rows(self) -> list[tuple[str, str, Any, str]]:
        """The env's options (name, type, default, meaning); lists only, so it takes none."""
        if self.option_args:
            given = " ".join(self.option_args)
            raise UsageError(
                f"--options lists the options of {self.name} and plays nothing; it takes no "
                f"name=value ({given}).",
                hint=f"To play with them give them without --options: roll debug-env "
                f"{self.env_arg} {given}.",
            )
        return list(describe_options(self.env_class))

    def validate_options(self) -> None:
        """Parse the ``name=value`` options and check them against the env's options."""
        self.kwargs = parse_option_args(self.option_args)
        validate_options(self.env_class, self.kwargs)

    def plan(self, *, seed: int, episodes: int | None, replay: Path | None) -> None:
        """The seeds to play (``seed``, ``seed + 1``, ...) or, with ``replay``, the recorded
        episodes (their first ``episodes``; None: all); makes the first episode's env."""
        self.replay = replay
        if replay is not None:
            self.recorded = read_episodes(replay, env=self.name)[:episodes]
            self._check_replay_options()
            self.seeds = [e.seed for e in self.recorded]
        else:
            self.seeds = [seed + i for i in range(episodes or 1)]
        self.env = self.env_class(**(self.recorded[0].options if self.recorded else self.kwargs))

    def _check_replay_options(self) -> None:
        given = validate_options(self.env_class, self.kwargs).model_dump(mode="json")
        differ = sorted(
            {k for e in self.recorded for k in self.kwargs if given[k] != e.options.get(k)}
        )
        if differ:
            raise UsageError(
                "--replay plays the episodes with their recorded options; the options given "
                f"differ from them ({', '.join(differ)}).",
                hint="Drop the name=value options when replaying.",
            )

    @property
    def env_options(self) -> dict[str, Any]:
        """The options of the env about to be played (after :meth:`plan`)."""
        assert self.env is not None, "plan() first"
        return self.env.options.model_dump()

    def make_policy(
        self, chosen: str, *, model: str | None, max_new_tokens: int, temperature: float
    ) -> Policy | None:
        """The random, expert or model policy (None for ``replay``: one per episode; the CLI
        makes the ``human`` one, which reads its terminal)."""
        if chosen == "model":
            from roll_core.envs.model_policy import ModelPolicy

            assert model is not None
            return ModelPolicy(model, max_new_tokens=max_new_tokens, temperature=temperature)
        if chosen == "random":
            return RandomPolicy()
        if chosen == "expert":
            return ExpertPolicy()
        return None

    def run(
        self,
        player: Policy | None,
        view: EpisodeView,
        *,
        record: Path | None,
        model: str | None,
        step_timeout: float,
        stop_on_abort: bool,
    ) -> list[Episode]:
        """Play every planned episode with ``player`` (or replay the recording), shown by
        ``view`` and written to ``record``; stops early when the player quits and
        ``stop_on_abort``. Returns the episodes played."""
        played: list[Episode] = []
        sink = open_record(record)
        try:
            for i, seed in enumerate(self.seeds):
                episode = self.play_one(i, seed, player, view, model, step_timeout)
                played.append(episode)
                if sink is not None:
                    write_episode(sink, episode)
                if episode.aborted and stop_on_abort:
                    break
        finally:
            if sink is not None:
                sink.close()
        return played

    def play_one(
        self,
        index: int,
        seed: int,
        player: Policy | None,
        view: EpisodeView,
        model: str | None,
        step_timeout: float,
    ) -> Episode:
        """Episode ``index``: played by ``player``, or replayed and checked to reproduce."""
        if self.replay is not None:
            player = ReplayPolicy(self.recorded[index])
            self.env = self.env_class(**self.recorded[index].options)
        assert self.env is not None and player is not None, "plan() first"
        view.begin(index, self.env_options)
        episode = play_episode(
            self.env,
            player,
            seed,
            on_start=view.start,
            on_prompt=view.prompt,
            on_turn=view.turn,
            model=model,
            step_timeout=step_timeout or None,
        )
        view.end(episode)
        if self.replay is not None:
            check_replay(self.recorded[index], episode, index=index)
        return episode

    @staticmethod
    def summary(played: list[Episode]) -> dict[str, float]:
        """Success rate, mean return and length, invalid-action rate of ``played``."""
        return summarize(played)
