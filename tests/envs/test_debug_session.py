"""The session behind `roll debug-env` (roll_core.envs.debug_session), without the terminal:
policy choice, seeds, recording and replay, option errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roll_core.envs.debug_session import DebugSession, choose_policy
from roll_core.envs.play import Episode, Turn
from roll_core.errors import UsageError


class Seen:
    """An EpisodeView that keeps what it was shown."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def begin(self, index: int, options: dict[str, Any]) -> None:
        self.events.append(("begin", index))

    def start(self, episode: Episode) -> None:
        self.events.append(("start", episode.seed))

    def prompt(self, number: int, observation: str) -> None:
        self.events.append(("prompt", number))

    def turn(self, number: int, turn: Turn) -> None:
        self.events.append(("turn", number))

    def end(self, episode: Episode) -> None:
        self.events.append(("end", len(episode.turns)))


def test_choose_policy() -> None:
    assert choose_policy(None, "builtin:tiny-qwen3", None, None, interactive=False) == "model"
    assert choose_policy(None, None, None, None, interactive=True) == "human"
    assert choose_policy(None, None, Path("r.jsonl"), None, interactive=False) == "replay"
    assert choose_policy("expert", "m", None, None, interactive=False, agent=True) == "expert"
    with pytest.raises(UsageError, match="stdin is not a terminal"):
        choose_policy(None, None, None, None, interactive=False)
    with pytest.raises(UsageError, match="--policy model needs --model"):
        choose_policy("model", None, None, None, interactive=False)
    with pytest.raises(UsageError, match="the policy is random"):
        choose_policy("random", "m", None, None, interactive=False)
    with pytest.raises(UsageError, match="takes no --policy"):
        choose_policy("random", None, Path("r.jsonl"), None, interactive=False)


def test_record_then_replay_reproduces(tmp_path: Path) -> None:
    record = tmp_path / "episodes.jsonl"
    session = DebugSession("frozen_lake", ["size=4"])
    session.validate_options()
    session.plan(seed=3, episodes=2, replay=None)
    assert session.seeds == [3, 4]
    player = session.make_policy("random", model=None, max_new_tokens=8, temperature=1.0)
    view = Seen()
    played = session.run(
        player, view, record=record, model=None, step_timeout=0, stop_on_abort=False
    )
    assert [e.seed for e in played] == [3, 4]
    assert view.events[0] == ("begin", 0) and ("begin", 1) in view.events
    assert session.summary(played)["episodes"] == 2

    again = DebugSession("frozen_lake", [])
    again.validate_options()
    again.plan(seed=0, episodes=None, replay=record)
    assert again.seeds == [3, 4]
    replayed = again.run(None, Seen(), record=None, model=None, step_timeout=0, stop_on_abort=False)
    assert [len(e.turns) for e in replayed] == [len(e.turns) for e in played]


def test_options_listing_takes_no_options() -> None:
    assert DebugSession("frozen_lake", []).option_rows()
    with pytest.raises(UsageError, match="--options lists the options"):
        DebugSession("frozen_lake", ["size=4"]).option_rows()
