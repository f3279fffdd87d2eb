"""Playing episodes outside training: policies, the episode loop, recordings and replays.

This is what ``roll debug-env`` runs: one process, no Ray. A :class:`Policy` answers each
observation with a response; :func:`play_episode` drives one env episode with it and returns
an :class:`Episode` (every turn's prompt, response, observation, reward and info);
:func:`write_episode` / :func:`read_episodes` store episodes as JSONL, one episode per line,
and :class:`ReplayPolicy` plays a recording back, checking that the env reproduces it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from roll_core.envs.base import TextEnv, observation_images
from roll_core.envs.faults import EnvFault, EnvTimeout, call_with_timeout, describe_fault
from roll_core.envs.registry import env_id
from roll_core.errors import DataError, RollError, UsageError

RECORDING_FORMAT = "roll-env-episode"
RECORDING_VERSION = 1


@dataclass
class Turn:
    """One step of an episode: what the policy saw, said, and what the env answered."""

    prompt: str  # the observation the policy answered
    response: str  # the policy's whole response (the env parses the action out of it)
    observation: str  # the env's next observation
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)
    policy_info: dict[str, Any] = field(default_factory=dict)  # e.g. token counts of a model
    observation_images: list[str] = field(default_factory=list)  # digests (image_digest)


@dataclass
class Episode:
    """A played episode; ``to_json``/``from_json`` give its line in a recording."""

    env: str
    options: dict[str, Any]
    seed: int
    policy: str
    system_prompt: str
    initial_observation: str
    turns: list[Turn] = field(default_factory=list)
    model: str | None = None
    aborted: bool = False  # the player quit before the episode ended
    initial_images: list[str] = field(default_factory=list)  # digests (image_digest)

    @property
    def episode_return(self) -> float:
        """Sum of the turns' rewards."""
        return float(sum(t.reward for t in self.turns))

    @property
    def success(self) -> bool:
        """Whether the last turn reported success."""
        return bool(self.turns and self.turns[-1].info.get("success", False))

    @property
    def done(self) -> bool:
        """Whether the episode ended (terminated or truncated)."""
        return bool(self.turns and (self.turns[-1].terminated or self.turns[-1].truncated))

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this episode (one line of a recording)."""
        return {
            "format": RECORDING_FORMAT,
            "version": RECORDING_VERSION,
            **asdict(self),
            "return": self.episode_return,
            "length": len(self.turns),
            "success": self.success,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Episode:
        """Parse one line of a recording (KeyError/TypeError/ValueError when malformed)."""
        turns = [Turn(**t) for t in data["turns"]]
        return cls(
            env=str(data["env"]),
            options=dict(data["options"]),
            seed=int(data["seed"]),
            policy=str(data["policy"]),
            system_prompt=str(data["system_prompt"]),
            initial_observation=str(data["initial_observation"]),
            turns=turns,
            model=data.get("model"),
            aborted=bool(data.get("aborted", False)),
            initial_images=list(data.get("initial_images", [])),
        )


class Policy(Protocol):
    """Answers observations for one episode at a time."""

    name: str

    def start(self, env: TextEnv, seed: int) -> None:
        """A new episode of ``env`` begins (seeded by ``seed``)."""

    def act(self, observation: str) -> str | None:
        """The response to ``observation``, or None to stop playing (a human quits)."""

    def turn_info(self) -> dict[str, Any]:
        """Facts about the last response to record with the turn (may be empty)."""


class RandomPolicy:
    """Uniformly random actions (``env.random_action``), reproducible from the seed."""

    name = "random"

    def __init__(self) -> None:
        self._env: TextEnv | None = None
        self._rng = np.random.default_rng(0)

    def start(self, env: TextEnv, seed: int) -> None:
        if type(env).random_action is TextEnv.random_action and not env_call(env, "valid_actions"):
            raise UsageError(
                f"env {env_id(type(env))} has no finite action set, so it cannot be "
                "played at random.",
                hint="Use --policy human or --policy model, or give the env valid_actions() "
                "or random_action() (see docs/envs.md).",
            )
        self._env = env
        self._rng = np.random.default_rng([seed, 0x5EED])  # independent of the env's stream

    def act(self, observation: str) -> str | None:
        assert self._env is not None, "start() first"
        return str(env_call(self._env, "random_action", self._rng))

    def turn_info(self) -> dict[str, Any]:
        return {}


class ExpertPolicy:
    """The env's own solver (``env.expert_action``); a random valid action where it has no
    move (a lost state), as in ``warm_start.policy: expert``."""

    name = "expert"

    def __init__(self) -> None:
        self._random = RandomPolicy()
        self._env: TextEnv | None = None

    def start(self, env: TextEnv, seed: int) -> None:
        if not type(env).has_expert():
            raise UsageError(
                f"env {env_id(type(env))} has no solver (no expert_action()), so it cannot be "
                "played by --policy expert.",
                hint="Use --policy random, human or model, or give the env expert_action() "
                "(see docs/envs.md).",
            )
        self._random.start(env, seed)
        self._env = env

    def act(self, observation: str) -> str | None:
        assert self._env is not None, "start() first"
        action = env_call(self._env, "expert_action")
        return self._random.act(observation) if action is None else str(action)

    def turn_info(self) -> dict[str, Any]:
        return {}


class ReplayPolicy:
    """Gives the responses of a recorded episode, in order; None once they are used up."""

    name = "replay"

    def __init__(self, episode: Episode) -> None:
        self.episode = episode
        self._next = 0

    def start(self, env: TextEnv, seed: int) -> None:
        self._next = 0

    def act(self, observation: str) -> str | None:
        if self._next >= len(self.episode.turns):
            return None
        response = self.episode.turns[self._next].response
        self._next += 1
        return response

    def turn_info(self) -> dict[str, Any]:
        return {}


def play_episode(
    env: TextEnv,
    policy: Policy,
    seed: int,
    *,
    on_start: Callable[[Episode], None] | None = None,
    on_prompt: Callable[[int, str], None] | None = None,
    on_turn: Callable[[int, Turn], None] | None = None,
    model: str | None = None,
    step_timeout: float | None = None,
) -> Episode:
    """Play one episode of ``env`` seeded by ``seed``; the callbacks see it as it happens.

    ``on_start(episode)`` after reset, ``on_prompt(turn_number, observation)`` before the
    policy acts and ``on_turn(turn_number, turn)`` after each step (turns count from 1).
    An exception raised by the env's ``reset``/``step``, or one that runs longer than
    ``step_timeout`` seconds (None: no limit), becomes an :class:`EnvFault` naming the env's
    error and the line that raised it.
    """
    observation, _ = env_call(env, "reset", seed, timeout=step_timeout)
    episode = Episode(
        env=env_id(type(env)),
        options=env.options.model_dump(mode="json"),
        seed=seed,
        policy=policy.name,
        system_prompt=env.system_prompt,
        initial_observation=observation,
        model=model,
        initial_images=image_digests(observation),
    )
    policy.start(env, seed)
    if on_start:
        on_start(episode)
    while not env.done:
        number = len(episode.turns) + 1
        if on_prompt:
            on_prompt(number, observation)
        response = policy.act(observation)
        if response is None:
            episode.aborted = True
            break
        result = env_call(env, "step", response, timeout=step_timeout)
        turn = Turn(
            prompt=observation,
            response=response,
            observation=result.observation,
            reward=result.reward,
            terminated=result.terminated,
            truncated=result.truncated,
            info=_jsonable(result.info),
            policy_info=policy.turn_info(),
            observation_images=image_digests(result.observation),
        )
        episode.turns.append(turn)
        if on_turn:
            on_turn(number, turn)
        observation = result.observation
    return episode


def image_digests(observation: str) -> list[str]:
    """``sha1:...`` of each image of an observation (size, mode and pixels), for recordings:
    a replay checks the pictures too, not only the text."""
    out = []
    for image in observation_images(observation):
        h = hashlib.sha1(f"{image.mode}:{image.width}x{image.height}:".encode())
        h.update(image.tobytes())
        out.append(f"sha1:{h.hexdigest()}")
    return out


def env_call(env: TextEnv, method: str, *args: Any, timeout: float | None = None) -> Any:
    """``env.method(*args)``; the env's own exceptions and hangs become :class:`EnvFault`."""
    name = env_id(type(env))
    try:
        fn = getattr(env, method)
        return fn(*args) if timeout is None else call_with_timeout(fn, *args, timeout=timeout)
    except RollError:
        raise  # already a user-facing error (e.g. options that cannot make a room)
    except EnvTimeout:
        raise EnvFault(
            f"env {name}: {method}() did not return within {timeout:g}s (the step timeout).",
            hint="The env hangs or is slow; fix it, or give --step-timeout more seconds "
            "(0: no limit).",
        ) from None
    except Exception as err:
        raise EnvFault(
            f"env {name} raised an exception in {method}(): {describe_fault(err)}",
            hint="This is an error in the env's code, not in roll; rerun with --debug for the "
            "full traceback.",
        ) from err


def check_replay(recorded: Episode, replayed: Episode, *, index: int) -> None:
    """Raise DataError where ``replayed`` differs from ``recorded`` (env changed or not seeded)."""
    where = f"episode {index + 1} (seed {recorded.seed})"
    pairs: list[tuple[str, Any, Any]] = [
        ("initial observation", recorded.initial_observation, replayed.initial_observation),
        ("initial observation's images", recorded.initial_images, replayed.initial_images),
    ]
    for n, (a, b) in enumerate(zip(recorded.turns, replayed.turns, strict=False), start=1):
        pairs += [
            (f"turn {n} observation", a.observation, b.observation),
            (f"turn {n} observation's images", a.observation_images, b.observation_images),
            (f"turn {n} reward", a.reward, b.reward),
            (f"turn {n} terminated", a.terminated, b.terminated),
            (f"turn {n} truncated", a.truncated, b.truncated),
        ]
    pairs.append(("number of turns", len(recorded.turns), len(replayed.turns)))
    for what, old, new in pairs:
        if old != new:
            raise DataError(
                f"replay of {where} diverged at the {what}: recorded {_short(old)}, "
                f"replayed {_short(new)}.",
                hint="The env is not the one that recorded the file (its code or options "
                "changed) or it is not deterministic for a seed; record the episode again.",
            )


def write_episode(stream: IO[str], episode: Episode) -> None:
    """Append ``episode`` as one JSON line and flush (a crash keeps finished episodes)."""
    stream.write(json.dumps(episode.to_json(), ensure_ascii=False) + "\n")
    stream.flush()


def read_episodes(path: Path, *, env: str | None = None) -> list[Episode]:
    """Episodes of a recording; ``env`` given: every episode must come from that env."""
    if not path.is_file():
        raise DataError(
            f"recording {path} does not exist.",
            hint="Make one with `roll debug-env ENV --record FILE`.",
        )
    episodes = []
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if not isinstance(data, dict) or data.get("format") != RECORDING_FORMAT:
                raise ValueError("not an episode written by `roll debug-env --record`")
            if data.get("version") != RECORDING_VERSION:
                raise ValueError(
                    f"format version {data.get('version')}, expected {RECORDING_VERSION}"
                )
            episode = Episode.from_json(data)
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(
                f"{path}, line {number}: not a roll episode recording ({type(err).__name__}: {err}).",
                hint="Replay a file written by `roll debug-env ENV --record FILE`.",
            ) from None
        if env is not None and episode.env != env:
            raise DataError(
                f"{path} was recorded from env '{episode.env}', not '{env}' (line {number}).",
                hint=f"Replay it with `roll debug-env {episode.env} --replay {path}`.",
            )
        episodes.append(episode)
    if not episodes:
        raise DataError(f"recording {path} holds no episodes.")
    return episodes


def summarize(episodes: Iterable[Episode]) -> dict[str, float]:
    """Mean return, success rate and mean length of ``episodes``."""
    eps = list(episodes)
    if not eps:
        return {"episodes": 0}
    return {
        "episodes": len(eps),
        "mean_return": float(np.mean([e.episode_return for e in eps])),
        "success_rate": float(np.mean([e.success for e in eps])),
        "mean_length": float(np.mean([len(e.turns) for e in eps])),
        "invalid_action_rate": _invalid_rate(eps),
    }


def _invalid_rate(eps: list[Episode]) -> float:
    turns = [t for e in eps for t in e.turns]
    if not turns:
        return 0.0
    return sum(not t.info.get("action_is_valid", True) for t in turns) / len(turns)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read recording {path}: {err}") from None


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with numpy scalars and other odd values made JSON-safe (round-trip equal)."""
    return json.loads(json.dumps(info, default=_default))


def _default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return repr(value)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
