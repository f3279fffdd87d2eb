"""Episodes outside training: random play, recordings, replays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll_core.envs import make_env
from roll_core.envs.play import (
    Episode,
    RandomPolicy,
    ReplayPolicy,
    check_replay,
    play_episode,
    read_episodes,
    summarize,
    write_episode,
)
from roll_core.errors import DataError


def _play(seed: int) -> Episode:
    return play_episode(make_env("frozen_lake", size=5, is_slippery=True), RandomPolicy(), seed)


def test_random_play_is_reproducible_and_complete() -> None:
    a, b = _play(4), _play(4)
    assert a == b
    assert a.done and not a.aborted and 1 <= len(a.turns) <= 20
    assert a.turns[0].prompt == a.initial_observation
    for before, after in zip(a.turns, a.turns[1:], strict=False):
        assert after.prompt == before.observation
    assert a.episode_return == pytest.approx(sum(t.reward for t in a.turns))
    assert a.options["size"] == 5 and a.env == "frozen_lake" and a.policy == "random"
    assert len({tuple(t.response for t in _play(s).turns) for s in range(6)}) > 1


def test_callbacks_see_the_episode_as_it_happens() -> None:
    events: list[tuple] = []
    play_episode(
        make_env("sokoban", room="######\n#@$_.#\n######"),
        ReplayPolicy(_episode_with(["Right", "Right"])),
        0,
        on_start=lambda ep: events.append(("start", ep.seed)),
        on_prompt=lambda n, obs: events.append(("prompt", n)),
        on_turn=lambda n, turn: events.append(("turn", n, turn.reward)),
    )
    assert events == [
        ("start", 0),
        ("prompt", 1),
        ("turn", 1, -0.1),
        ("prompt", 2),
        ("turn", 2, 10.9),
    ]


def _episode_with(responses: list[str]) -> Episode:
    env = make_env("sokoban", room="######\n#@$_.#\n######")
    episode = play_episode(env, _Scripted(responses), 0)
    return episode


class _Scripted:
    name = "scripted"

    def __init__(self, responses: list[str]) -> None:
        self.responses = list(responses)

    def start(self, env: object, seed: int) -> None:
        pass

    def act(self, observation: str) -> str | None:
        return self.responses.pop(0) if self.responses else None

    def turn_info(self) -> dict:
        return {}


def test_stopping_policy_aborts_the_episode() -> None:
    episode = _episode_with(["Up"])
    assert episode.aborted and len(episode.turns) == 1 and not episode.done


def test_record_and_replay_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "episodes.jsonl"
    episodes = [_play(s) for s in range(3)]
    with path.open("w") as f:
        for e in episodes:
            write_episode(f, e)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["format"] == "roll-env-episode" and first["env"] == "frozen_lake"
    assert first["return"] == episodes[0].episode_return and first["length"] == len(
        episodes[0].turns
    )

    loaded = read_episodes(path, env="frozen_lake")
    assert loaded == episodes
    for i, recorded in enumerate(loaded):
        env = make_env("frozen_lake", **recorded.options)
        replayed = play_episode(env, ReplayPolicy(recorded), recorded.seed)
        check_replay(recorded, replayed, index=i)  # identical: no error

    stats = summarize(loaded)
    assert stats["episodes"] == 3
    assert stats["success_rate"] == pytest.approx(sum(e.success for e in episodes) / 3)


def test_replay_detects_divergence_and_foreign_files(tmp_path: Path) -> None:
    recorded = _play(1)
    tampered = Episode(**{**recorded.__dict__, "turns": list(recorded.turns)})
    tampered.turns[0] = type(recorded.turns[0])(**{**recorded.turns[0].__dict__, "reward": 5.0})
    with pytest.raises(DataError, match="diverged at the turn 1 reward: recorded 5.0, replayed"):
        check_replay(tampered, recorded, index=0)

    path = tmp_path / "lake.jsonl"
    with path.open("w") as f:
        write_episode(f, recorded)
    with pytest.raises(DataError, match="recorded from env 'frozen_lake', not 'sokoban'") as err:
        read_episodes(path, env="sokoban")
    assert f"roll debug-env frozen_lake --replay {path}" in (err.value.hint or "")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"some": "json"}\n')
    with pytest.raises(DataError, match="line 1: not a roll episode recording"):
        read_episodes(bad)
    with pytest.raises(DataError, match="does not exist"):
        read_episodes(tmp_path / "missing.jsonl")


def test_random_policy_needs_an_action_set() -> None:
    from roll_core.envs import TextEnv, Transition
    from roll_core.errors import UsageError

    class FreeText(TextEnv):
        def on_reset(self, rng: object) -> tuple[str, dict]:
            return "say anything", {}

        def parse_action(self, text: str) -> str:
            return text

        def on_step(self, action: str) -> Transition:
            return Transition("ok", 0.0, True)

        def render(self) -> str:
            return ""

    with pytest.raises(UsageError, match="has no finite action set"):
        play_episode(FreeText(), RandomPolicy(), 0)


@pytest.mark.parametrize("name", ["sokoban", "frozen_lake", "tool_use"])
def test_every_registered_env_plays_to_the_end_at_random(name: str) -> None:
    from roll_core.envs import registered_envs

    assert name in registered_envs()
    episode = play_episode(make_env(name, max_steps=4), RandomPolicy(), seed=2)
    assert episode.done and 1 <= len(episode.turns) <= 4
    assert all("action_is_valid" in t.info and "success" in t.info for t in episode.turns)
    assert episode.turns[-1].info["step"] == len(episode.turns)
