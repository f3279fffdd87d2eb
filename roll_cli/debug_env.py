"""`roll debug-env ENV`: play an env, or watch a random, expert or model policy play it.

Single process, no Ray, no GPU needed. The session (env, options, policy, seeds, the loop over
episodes, recording and replay) is :class:`roll_core.envs.debug_session.DebugSession`, and for
agent programs :class:`roll_core.rollout.agentic.debug_session.AgentDebugSession`; this module
parses the command line, reads a human's keys and prints each turn.
"""

from __future__ import annotations

import enum
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from roll_cli.common import Debug, handle_errors
from roll_cli.human_play import HumanPolicy

if TYPE_CHECKING:
    from roll_core.envs.debug_session import DebugSession

out = Console(highlight=False)


class PolicyName(enum.StrEnum):
    """Who plays."""

    human = "human"
    random = "random"
    expert = "expert"
    model = "model"


EnvArg = Annotated[
    str,
    typer.Argument(
        help="Env name (sokoban, frozen_lake, tool_use, swe), a GEM env gem:ID "
        "(gem:game:GuessTheNumber-v0-easy), a user env package.module:Class, or an agent "
        "program agent:path/to/agent.py:run (played by --policy model or expert).",
        show_default=False,
    ),
]

OptionsArg = Annotated[
    list[str] | None,
    typer.Argument(help="Env options name=value (e.g. width=7 num_boxes=2).", show_default=False),
]

SeedArg = Annotated[
    int,
    typer.Option("--seed", min=0, help="Seed of the first episode (episode i uses seed + i)."),
]

EpisodesArg = Annotated[
    int | None,
    typer.Option(
        "--episodes",
        min=1,
        help="Episodes to play (default 1; with --replay, all of the file's).",
        show_default=False,
    ),
]

PolicyArg = Annotated[
    PolicyName | None,
    typer.Option(
        "--policy",
        help="Who plays: human (typed or arrow-key actions), random, expert (the env's "
        "solver, e.g. Sokoban's BFS), or model (--model). "
        "Default: human when stdin is a terminal.",
        show_default=False,
    ),
]

ModelArg = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Model for --policy model: a local HF model, hub id or builtin:NAME. With an "
        "agent and --policy expert: the tokenizer and context the expert's text is shown "
        "in (the recipe's model.path).",
        show_default=False,
    ),
]

RecordArg = Annotated[
    Path | None,
    typer.Option("--record", help="Write the episodes to FILE (JSONL).", show_default=False),
]

ReplayArg = Annotated[
    Path | None,
    typer.Option(
        "--replay",
        help="Play back the episodes of a --record FILE, checking they reproduce.",
        show_default=False,
    ),
]

MaxNewTokensArg = Annotated[
    int, typer.Option("--max-new-tokens", min=1, help="Tokens per model response.")
]

TemperatureArg = Annotated[
    float,
    typer.Option("--temperature", min=0.0, help="Model sampling temperature (0: greedy)."),
]

StepTimeoutArg = Annotated[
    float,
    typer.Option(
        "--step-timeout",
        min=0.0,
        help="Seconds an env reset/step may take before it is reported as hung (0: no limit).",
    ),
]

ImageDirArg = Annotated[
    Path | None,
    typer.Option(
        "--image-dir",
        help="Where image observations (obs_mode=image) are saved as PNG, one file per "
        "turn. Default: runs/debug-env/ENV-TIME/.",
        show_default=False,
    ),
]

ChatTemplateArg = Annotated[
    Path | None,
    typer.Option(
        "--chat-template",
        help="Agents (agent:...): a Jinja chat-template file for --model instead of its "
        "own (as rollout.chat_template; e.g. one with tool support for builtin models).",
        show_default=False,
    ),
]

ListOptionsArg = Annotated[
    bool,
    typer.Option(
        "--options", help="List the env's options (name, type, default, meaning) and exit."
    ),
]


@handle_errors
def debug_env(
    env: EnvArg,
    options: OptionsArg = None,
    seed: SeedArg = 0,
    episodes: EpisodesArg = None,
    policy: PolicyArg = None,
    model: ModelArg = None,
    record: RecordArg = None,
    replay: ReplayArg = None,
    max_new_tokens: MaxNewTokensArg = 64,
    temperature: TemperatureArg = 1.0,
    step_timeout: StepTimeoutArg = 30.0,
    image_dir: ImageDirArg = None,
    chat_template: ChatTemplateArg = None,
    list_options: ListOptionsArg = False,
    debug: Debug = False,
) -> None:
    """Play an env in the terminal or watch a random, expert or model policy play it (no Ray).

    Keys (--policy human, at a terminal):
      arrow keys:   move (sokoban, frozen_lake)
      other keys:   start a typed action; Enter sends it
      while typing: Backspace, Delete, Left/Right, Home/End, Ctrl-A/E/U/W,
                    Up/Down (earlier actions)
      paste:        shown as it arrives; a pasted line with Enter is sent
      q, Ctrl-D:    quit
    Free-text envs (tool_use) read every action as such a line.
    Without a terminal, each line of stdin is one action.
    `roll debug-env ENV --options` lists the env's options.
    Image observations (e.g. `roll debug-env sokoban obs_mode=image`) are saved as PNG files
    (--image-dir), their paths printed each turn, and drawn inline in terminals that speak
    the kitty, iTerm2 or sixel image protocol.
    """
    from roll_core.envs.debug_session import DebugSession, choose_policy

    interactive = sys.stdin.isatty()
    wanted = policy.value if policy is not None else None
    if env.startswith("agent:"):
        chosen = choose_policy(wanted, model, replay, record, interactive=interactive, agent=True)
        _check_agent_policy(chosen, replay)
        _debug_agent(
            env.removeprefix("agent:"),
            options or [],
            seed,
            episodes or 1,
            model,
            chat_template,
            max_new_tokens,
            temperature,
            expert=chosen == "expert",
        )
        return
    session = DebugSession(env, options or [])
    if list_options:
        _print_options(session)
        return
    session.validate_options()
    chosen = choose_policy(wanted, model, replay, record, interactive=interactive)
    session.plan(seed=seed, episodes=episodes, replay=replay)
    _play(
        session,
        chosen,
        model=model,
        record=record,
        replay=replay,
        image_dir=image_dir,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        step_timeout=step_timeout,
    )


def _play(
    session: DebugSession,
    chosen: str,
    *,
    model: str | None,
    record: Path | None,
    replay: Path | None,
    image_dir: Path | None,
    max_new_tokens: int,
    temperature: float,
    step_timeout: float,
) -> None:
    """Play (or replay) the session's episodes with the chosen policy, printing each turn."""
    printer = _Printer(session.env_options, len(session.seeds))
    printer.images = _ImageSaver(image_dir or _default_image_dir(session.name))
    player = session.make_policy(
        chosen, model=model, max_new_tokens=max_new_tokens, temperature=temperature
    )
    if chosen == "model":
        from roll_core.envs.model_policy import ModelPolicy

        assert isinstance(player, ModelPolicy)
        out.print(f"model: {model} (context {player.context} tokens)", style="dim")
    elif chosen == "human":
        player = HumanPolicy(sys.stdin)
    try:
        played = session.run(
            player,
            printer,
            record=record,
            model=model if chosen == "model" else None,
            step_timeout=step_timeout,
            stop_on_abort=chosen == "human",
        )
    finally:
        if isinstance(player, HumanPolicy):
            player.close()
    printer.summary(session.summary(played), record, replay)


def _check_agent_policy(chosen: str, replay: Path | None) -> None:
    from roll_core.errors import UsageError

    if chosen not in ("model", "expert") or replay is not None:
        raise UsageError(
            f"an agent program plays with --policy model or --policy expert (got "
            f"{'--replay' if replay is not None else '--policy ' + chosen}).",
            hint="roll debug-env agent:path/to/agent.py:run --policy model --model "
            "builtin:tiny-qwen3 --chat-template FILE",
        )


def _print_options(session: DebugSession) -> None:
    from rich.table import Table

    rows = session.option_rows()
    table = Table(title=f"options of {session.name}", title_justify="left")
    for col in ("option", "type", "default", "meaning"):
        table.add_column(col, overflow="fold")
    for name, type_name, default, description in rows:
        table.add_row(name, type_name, repr(default), description)
    out.print(table)
    out.print(f"Give them as name=value: roll debug-env {session.name} NAME=VALUE ...", style="dim")


# ---- output ----------------------------------------------------------------------------------
def _default_image_dir(env_name: str) -> Path:
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in env_name)
    return Path("runs") / "debug-env" / f"{safe}-{stamp}-{os.getpid()}"


class _ImageSaver:
    """Saves the pictures of image observations (PNG), prints each path, draws them inline
    where the terminal can (:mod:`roll_cli.term_images`). The directory is made on first use."""

    def __init__(self, directory: Path) -> None:
        from roll_cli.term_images import terminal_protocol

        self.directory = directory
        self.protocol = terminal_protocol()

    def show(self, observation: str, label: str) -> None:
        from roll_core.envs.base import observation_images
        from roll_core.errors import UsageError

        images = observation_images(observation)
        for k, image in enumerate(images):
            path = self.directory / (f"{label}.png" if len(images) == 1 else f"{label}-{k + 1}.png")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                image.save(path)
            except OSError as err:
                raise UsageError(
                    f"cannot save the image observation {path}: {err.strerror or err}.",
                    hint="Give --image-dir a writable directory.",
                ) from None
            out.print(
                Text(f"image {image.width}x{image.height}: {path}", style="dim"), soft_wrap=True
            )
            if self.protocol is not None:
                from roll_cli.term_images import inline_image

                out.file.write(inline_image(image, self.protocol) + "\n")
                out.file.flush()


def _shown(text: str) -> Text:
    """``text`` for the terminal: control characters escaped, never interpreted as markup."""
    return Text("".join(ch if ch.isprintable() or ch in "\n\t" else repr(ch)[1:-1] for ch in text))


class _Printer:
    """Per-turn layout: the prompt the policy saw, its response, the reward, then the end."""

    def __init__(self, options: dict[str, Any], total: int) -> None:
        self.options = options
        self.total = total
        self.index = 0
        self.images: _ImageSaver | None = None

    def begin(self, index: int, options: dict[str, Any]) -> None:
        self.index, self.options = index, options

    def start(self, episode: Any) -> None:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        out.rule(
            f"episode {self.index + 1}/{self.total} · {episode.env} · seed {episode.seed} · {episode.policy}"
        )
        out.print(Text(f"options: {opts}", style="dim"))
        if episode.system_prompt:
            out.print(
                Panel(
                    Text(episode.system_prompt),
                    title="system prompt",
                    title_align="left",
                    border_style="dim",
                )
            )

    def prompt(self, number: int, observation: str) -> None:
        from roll_core.envs.base import observation_tool_results  # lazy: fast --help

        results = observation_tool_results(observation)  # tool messages, one per call
        out.print(
            Panel(
                _shown(observation),
                title=f"turn {number} · " + ("tool results" if results else "prompt"),
                title_align="left",
                border_style="cyan",
                expand=False,
            )
        )
        if self.images is not None:
            self.images.show(observation, f"episode{self.index + 1:02d}-turn{number:02d}")

    def turn(self, number: int, turn: Any) -> None:
        valid = turn.info.get("action_is_valid", True)
        extra = turn.policy_info
        subtitle = (
            f"{extra['response_tokens']} tokens, {extra['finish_reason']}"
            + (
                f", {extra['dropped_turns']} old turns dropped"
                if extra.get("dropped_turns")
                else ""
            )
            if "response_tokens" in extra
            else None
        )
        out.print(
            Panel(
                _shown(turn.response) if turn.response.strip() else Text("(empty)"),
                title=f"turn {number} · response",
                title_align="left",
                subtitle=subtitle,
                subtitle_align="right",
                border_style="green" if valid else "red",
                expand=False,
            )
        )
        status = Text()
        if valid:
            action, tool = turn.info.get("action"), turn.info.get("tool")
            tools = turn.info.get("tools") or ([tool] if tool else [])
            what = (
                f"action {action}"
                if action
                else f"{', '.join(tools)} call"
                if tools
                else "action ok"
            )
            status.append(what, style="green")
        else:
            status.append(f"invalid action: {turn.info.get('invalid_reason', '?')}", style="red")
        status.append(
            f"   reward {turn.reward:+.2f}   return {turn.info.get('episode_return', 0.0):+.2f}"
        )
        if turn.terminated:
            status.append("   terminated", style="bold")
        if turn.truncated:
            status.append("   truncated (max_steps)", style="bold")
        out.print(status)

    def end(self, episode: Any) -> None:
        if episode.turns:
            out.print(
                Panel(
                    _shown(episode.turns[-1].observation),
                    title="final observation",
                    title_align="left",
                    border_style="magenta",
                    expand=False,
                )
            )
            if self.images is not None:
                self.images.show(
                    episode.turns[-1].observation, f"episode{self.index + 1:02d}-final"
                )
        outcome = "quit" if episode.aborted else "success" if episode.success else "failure"
        out.print(
            Text(
                f"episode {self.index + 1}: {outcome}, return {episode.episode_return:+.2f}, "
                f"{len(episode.turns)} turn{'s' if len(episode.turns) != 1 else ''}",
                style="bold green" if episode.success else "bold",
            )
        )

    def summary(self, stats: dict[str, float], record: Path | None, replay: Path | None) -> None:
        n = int(stats.get("episodes", 0))
        if n:
            out.rule()
            out.print(
                f"{n} episode{'s' if n != 1 else ''}: success rate {stats['success_rate']:.0%}, "
                f"mean return {stats['mean_return']:+.2f}, mean length {stats['mean_length']:.1f} turns, "
                f"invalid actions {stats['invalid_action_rate']:.0%}"
            )
        if replay is not None:
            out.print(f"replayed {replay}: every observation and reward reproduced", style="green")
        if record is not None:
            out.print(f"recorded {n} episode{'s' if n != 1 else ''} to {record}")


def _debug_agent(
    path: str,
    options: list[str],
    seed: int,
    episodes: int,
    model: str | None,
    chat_template: Path | None,
    max_new_tokens: int,
    temperature: float,
    *,
    expert: bool = False,
) -> None:
    """Play an agent program's episodes through the endpoint, answered by the model (or by the
    module's expert, in --model's tokenizer and context when given); print each call."""
    from roll_core.envs import parse_option_args
    from roll_core.rollout.agentic.debug_session import AgentDebugSession

    session = AgentDebugSession(
        path,
        parse_option_args(options),
        model=model,
        chat_template=chat_template,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        expert=expert,
    )

    def show(traj: Any, i: int, task: Any) -> None:
        _print_agent_episode(traj, session.tokenizer, i, episodes, task)

    session.run(seed, episodes, show)


def _print_agent_episode(traj: Any, tokenizer: Any, i: int, total: int, task: Any) -> None:
    out.rule(f"episode {i + 1}/{total} · seed {traj.seed} · task {task!r}")
    seen = 0
    for k, turn in enumerate(traj.turns, start=1):
        new = turn.prompt_ids[seen:]
        out.print(f"[bold]call {k}[/bold] · {len(turn.prompt_ids)} prompt tokens", highlight=False)
        out.print(_shown(tokenizer.decode(new)), style="dim")
        out.print(_shown(tokenizer.decode(turn.response_ids)))
        if not turn.action_is_valid:
            out.print("(not a call of a declared tool: returned as content)", style="yellow")
        seen = len(turn.prompt_ids) + len(turn.response_ids)
    end = f"status {traj.status} · reward {traj.episode_return:g} · success {traj.success}"
    out.print(end + (f" · error: {traj.error}" if traj.error else ""), highlight=False)
