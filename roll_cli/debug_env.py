"""`roll debug-env ENV`: play an env, or watch a random, expert or model policy play it.

Single process, no Ray, no GPU needed. The episode loop, policies and recordings live in
:mod:`roll_core.envs.play`; this module parses the command line, reads a human's keys and
prints each turn.
"""

from __future__ import annotations

import enum
import os
import select
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from roll_cli.common import Debug, handle_errors

out = Console(highlight=False)


class PolicyName(enum.StrEnum):
    """Who plays."""

    human = "human"
    random = "random"
    expert = "expert"
    model = "model"


@handle_errors
def debug_env(
    env: Annotated[
        str,
        typer.Argument(
            help="Env name (sokoban, frozen_lake, tool_use, swe), a GEM env gem:ID "
            "(gem:game:GuessTheNumber-v0-easy), a user env package.module:Class, or an agent "
            "program agent:path/to/agent.py:run (played by --policy model or expert).",
            show_default=False,
        ),
    ],
    options: Annotated[
        list[str] | None,
        typer.Argument(
            help="Env options name=value (e.g. width=7 num_boxes=2).", show_default=False
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option("--seed", min=0, help="Seed of the first episode (episode i uses seed + i)."),
    ] = 0,
    episodes: Annotated[
        int | None,
        typer.Option(
            "--episodes",
            min=1,
            help="Episodes to play (default 1; with --replay, all of the file's).",
            show_default=False,
        ),
    ] = None,
    policy: Annotated[
        PolicyName | None,
        typer.Option(
            "--policy",
            help="Who plays: human (typed or arrow-key actions), random, expert (the env's "
            "solver, e.g. Sokoban's BFS), or model (--model). "
            "Default: human when stdin is a terminal.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Model for --policy model: a local HF model, hub id or builtin:NAME. With an "
            "agent and --policy expert: the tokenizer and context the expert's text is shown "
            "in (the recipe's model.path).",
            show_default=False,
        ),
    ] = None,
    record: Annotated[
        Path | None,
        typer.Option("--record", help="Write the episodes to FILE (JSONL).", show_default=False),
    ] = None,
    replay: Annotated[
        Path | None,
        typer.Option(
            "--replay",
            help="Play back the episodes of a --record FILE, checking they reproduce.",
            show_default=False,
        ),
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Tokens per model response.")
    ] = 64,
    temperature: Annotated[
        float,
        typer.Option("--temperature", min=0.0, help="Model sampling temperature (0: greedy)."),
    ] = 1.0,
    step_timeout: Annotated[
        float,
        typer.Option(
            "--step-timeout",
            min=0.0,
            help="Seconds an env reset/step may take before it is reported as hung (0: no limit).",
        ),
    ] = 30.0,
    image_dir: Annotated[
        Path | None,
        typer.Option(
            "--image-dir",
            help="Where image observations (obs_mode=image) are saved as PNG, one file per "
            "turn. Default: runs/debug-env/ENV-TIME/.",
            show_default=False,
        ),
    ] = None,
    chat_template: Annotated[
        Path | None,
        typer.Option(
            "--chat-template",
            help="Agents (agent:...): a Jinja chat-template file for --model instead of its "
            "own (as rollout.chat_template; e.g. one with tool support for builtin models).",
            show_default=False,
        ),
    ] = None,
    list_options: Annotated[
        bool,
        typer.Option(
            "--options", help="List the env's options (name, type, default, meaning) and exit."
        ),
    ] = False,
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
    from roll_core.envs import get_env_class, parse_option_args
    from roll_core.envs.play import (
        Episode,
        ReplayPolicy,
        check_replay,
        play_episode,
        read_episodes,
        summarize,
        write_episode,
    )
    from roll_core.envs.registry import env_id, validate_options
    from roll_core.errors import UsageError

    if env.startswith("agent:"):
        chosen = _choose_policy(policy, model, replay, record, agent=True)
        if chosen not in ("model", "expert") or replay is not None:
            raise UsageError(
                f"an agent program plays with --policy model or --policy expert (got "
                f"{'--replay' if replay is not None else '--policy ' + chosen}).",
                hint="roll debug-env agent:path/to/agent.py:run --policy model --model "
                "builtin:tiny-qwen3 --chat-template FILE",
            )
        _debug_agent(
            env.removeprefix("agent:"),
            parse_option_args(options or []),
            seed,
            episodes or 1,
            model,
            chat_template,
            max_new_tokens,
            temperature,
            expert=chosen == "expert",
        )
        return
    cls = get_env_class(env)
    name = env_id(cls)
    if list_options:
        if options:
            raise UsageError(
                f"--options lists the options of {name} and plays nothing; it takes no "
                f"name=value ({' '.join(options)}).",
                hint=f"To play with them give them without --options: roll debug-env {env} "
                f"{' '.join(options)}.",
            )
        _print_options(cls)
        return
    kwargs = parse_option_args(options or [])
    validate_options(cls, kwargs)
    chosen = _choose_policy(policy, model, replay, record)

    recorded: list[Episode] = []
    if replay is not None:
        recorded = read_episodes(replay, env=name)[:episodes]  # None: all of them
        given = validate_options(cls, kwargs).model_dump(mode="json")
        differ = sorted({k for e in recorded for k in kwargs if given[k] != e.options.get(k)})
        if differ:
            raise UsageError(
                "--replay plays the episodes with their recorded options; the options given "
                f"differ from them ({', '.join(differ)}).",
                hint="Drop the name=value options when replaying.",
            )
        seeds = [e.seed for e in recorded]
    else:
        seeds = [seed + i for i in range(episodes or 1)]

    instance = cls(**(recorded[0].options if recorded else kwargs))
    printer = _Printer(instance.options.model_dump(), len(seeds))
    printer.images = _ImageSaver(image_dir or _default_image_dir(name))
    player: Any
    if chosen == "model":
        from roll_core.envs.model_policy import ModelPolicy

        assert model is not None
        player = ModelPolicy(model, max_new_tokens=max_new_tokens, temperature=temperature)
        out.print(f"model: {model} (context {player.context} tokens)", style="dim")
    elif chosen == "random":
        from roll_core.envs.play import RandomPolicy

        player = RandomPolicy()
    elif chosen == "expert":
        from roll_core.envs.play import ExpertPolicy

        player = ExpertPolicy()
    elif chosen == "human":
        player = HumanPolicy(sys.stdin)

    played: list[Episode] = []
    sink = _open_record(record)
    try:
        for i, episode_seed in enumerate(seeds):
            if replay is not None:
                player = ReplayPolicy(recorded[i])
                instance = cls(**recorded[i].options)
                printer.options = instance.options.model_dump()
            printer.index = i
            episode = play_episode(
                instance,
                player,
                episode_seed,
                on_start=printer.start,
                on_prompt=printer.prompt,
                on_turn=printer.turn,
                model=model if chosen == "model" else None,
                step_timeout=step_timeout or None,
            )
            printer.end(episode)
            if replay is not None:
                check_replay(recorded[i], episode, index=i)
            played.append(episode)
            if sink is not None:
                write_episode(sink, episode)
            if episode.aborted and chosen == "human":
                break
    finally:
        if isinstance(player, HumanPolicy):
            player.close()
        if sink is not None:
            sink.close()
    printer.summary(summarize(played), record, replay)


def _print_options(cls: Any) -> None:
    from rich.table import Table

    from roll_core.envs.registry import describe_options, env_id

    table = Table(title=f"options of {env_id(cls)}", title_justify="left")
    for col in ("option", "type", "default", "meaning"):
        table.add_column(col, overflow="fold")
    for name, type_name, default, description in describe_options(cls):
        table.add_row(name, type_name, repr(default), description)
    out.print(table)
    out.print(f"Give them as name=value: roll debug-env {env_id(cls)} NAME=VALUE ...", style="dim")


def _open_record(path: Path | None) -> IO[str] | None:
    from roll_core.errors import UsageError

    if path is None:
        return None
    try:
        return path.open("w", encoding="utf-8")
    except OSError as err:
        raise UsageError(
            f"cannot write the recording {path}: {err.strerror}.",
            hint="Give --record a file in a directory that exists and is writable.",
        ) from None


def _choose_policy(
    policy: PolicyName | None,
    model: str | None,
    replay: Path | None,
    record: Path | None,
    *,
    agent: bool = False,
) -> str:
    from roll_core.errors import UsageError

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
        if sys.stdin.isatty():
            return "human"
        raise UsageError(
            "no --policy given and stdin is not a terminal, so nobody can play by hand.",
            hint="Choose a policy: --policy random, --policy model --model PATH (e.g. "
            "builtin:tiny-qwen3), --replay FILE, or --policy human to read actions from stdin, "
            "one per line.",
        )
    if policy is PolicyName.model and model is None:
        raise UsageError(
            "--policy model needs --model.",
            hint="Give a local HF model directory, a hub id or a built-in model, e.g. "
            "--model builtin:tiny-qwen3.",
        )
    if agent and policy is PolicyName.expert:
        return policy.value  # --model: the tokenizer and context of the expert's text
    if policy is not PolicyName.model and model is not None:
        raise UsageError(
            f"--model is only used with --policy model (the policy is {policy.value}).",
            hint="Drop --model, or use --policy model.",
        )
    return policy.value


# ---- human play ------------------------------------------------------------------------------
# Names of the keys an escape sequence may stand for (CSI ``ESC [ params final`` or SS3
# ``ESC O final``); keys without a name here are read whole and ignored.
_KEY_NAMES: Mapping[str, str] = {"A": "up", "B": "down", "C": "right", "D": "left"}


class HumanPolicy:
    """A person at the terminal: arrow keys for grid games, else typed lines; Ctrl-D quits.

    With a terminal on stdin and an env that maps arrow keys (``env.key_actions``), one key
    press is one action; any other key starts a typed action finished with Enter. Without a
    terminal, each line of stdin is one action. For key play the terminal stays in cbreak
    mode (keys are read one by one, not echoed) from the first episode until :meth:`close`,
    so keys pressed while a turn is printed are neither echoed nor lost.

    Typed actions are read with GNU readline (Python's ``input``): line editing (Backspace,
    Delete, arrows, Home/End, Ctrl-A/E/U/W), a history of earlier actions, and echo of pasted
    text, with no new dependency and nothing that takes over the screen (prompt_toolkit
    would, and rich prints every turn). The key that started a typed action, and whatever was
    pasted with it, is handed to readline as the line's start, so it is shown and editable.
    """

    name = "human"

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.keys: Mapping[str, str] = {}
        self._saved: list[Any] | None = None  # terminal attributes to restore

    @property
    def _editing(self) -> bool:
        """Whether typed lines go through readline (stdin and stdout are a terminal)."""
        return self.stream is sys.stdin and self.stream.isatty() and sys.stdout.isatty()

    def start(self, env: Any, seed: int) -> None:
        self.keys = env.key_actions
        if self.keys and self.stream.isatty() and self._saved is None:
            import termios
            import tty

            self._saved = termios.tcgetattr(self.stream.fileno())
            tty.setcbreak(self.stream.fileno())

    def close(self) -> None:
        """Give the terminal its settings back."""
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.stream.fileno(), termios.TCSADRAIN, self._saved)
            self._saved = None

    def turn_info(self) -> dict[str, Any]:
        return {}

    def act(self, observation: str) -> str | None:
        if self._saved is not None:
            return self._read_key_action()
        return self._read_line("action (Enter to send, Ctrl-D quits)> ")

    def _read_line(self, prompt: str, start: str = "") -> str | None:
        """One typed line (``start``: text already typed, shown and editable); None at EOF."""
        if self._editing:
            return _edit_line(prompt, start)
        if prompt:
            out.print(prompt, end="", style="bold")
        line = self.stream.readline()
        if not line:  # EOF: Ctrl-D or the end of piped input
            out.print()
            return None
        if not self.stream.isatty():  # no terminal echoed it: show what was read
            out.print(Text(line.rstrip("\n")))
        return start + line.rstrip("\n")

    def _read_key_action(self) -> str | None:
        import termios
        import tty

        out.print(
            "move (arrow keys, or type an action + Enter; q or Ctrl-D quits)> ",
            end="",
            style="bold",
        )
        fd = self.stream.fileno()
        while True:
            key = _read_key(fd)
            if key in ("q", "\x04", ""):
                out.print()
                return None
            if key in self.keys:
                out.print(self.keys[key])
                return self.keys[key]
            if len(key) != 1 or not key.isprintable():
                continue  # Enter, Backspace, PgUp, Delete, ...: nothing to act on yet
            typed = key + _pending(fd)  # the rest of a paste arrives with its first key
            line, ended, _ = typed.replace("\n", "\r").partition("\r")
            if ended:  # a pasted action with its Enter: it is complete
                shown = _printable(line)
                out.print(Text(shown))
                return shown
            assert self._saved is not None
            termios.tcsetattr(fd, termios.TCSANOW, self._saved)
            try:
                out.print()  # readline redraws the prompt with the text typed so far
                return self._read_line("action> ", _printable(line))
            finally:
                tty.setcbreak(fd)


def _edit_line(prompt: str, start: str) -> str | None:
    """``input(prompt)`` with readline editing, the line pre-filled with ``start``."""
    import readline

    def prefill() -> None:
        readline.insert_text(start)
        readline.redisplay()

    readline.set_pre_input_hook(prefill if start else None)
    sys.stdout.flush()
    try:
        # \001 and \002 tell readline the bold escapes take no room on the screen
        return input(f"\001\x1b[1m\002{prompt}\001\x1b[0m\002")
    except EOFError:  # Ctrl-D on an empty line
        out.print()
        return None
    finally:
        readline.set_pre_input_hook(None)


def _printable(text: str) -> str:
    """``text`` with control characters dropped and Backspace applied (a pasted line)."""
    kept: list[str] = []
    for ch in text:
        if ch in ("\x7f", "\b"):
            if kept:
                kept.pop()
        elif ch.isprintable():
            kept.append(ch)
    return "".join(kept)


def _pending(fd: int) -> str:
    """Bytes already waiting on ``fd`` (the rest of a paste or of fast typing), decoded."""
    data = b""
    while select.select([fd], [], [], 0.02)[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def _read_key(fd: int) -> str:
    """One key press from a terminal in cbreak mode: a character, ``up``/``down``/``left``/
    ``right``, or another escape sequence read whole (``\x1b[5~`` for PgUp, ``\x1b[3~`` for
    Delete, ...) so that none of its bytes is taken for a typed key."""
    data = os.read(fd, 1)
    if not data:
        return ""
    if data == b"\x1b":
        return _read_escape(fd)
    if data[0] >= 0x80:  # the rest of a UTF-8 character
        while select.select([fd], [], [], 0.01)[0] and len(data) < 4:
            data += os.read(fd, 1)
    return data.decode(errors="replace")


def _read_escape(fd: int) -> str:
    """The rest of an escape sequence after ESC (its bytes arrive together, within 50 ms).

    CSI (``ESC [``) runs to a final byte in ``@``..``~`` after any parameter bytes; SS3
    (``ESC O``) is one more byte; ``ESC x`` is Alt+x; a lone ESC is the Escape key.
    """

    def byte() -> bytes:
        return os.read(fd, 1) if select.select([fd], [], [], 0.05)[0] else b""

    intro = byte()
    if intro == b"[":
        body = b""
        while True:
            b = byte()
            if not b:
                break
            body += b
            if 0x40 <= b[0] <= 0x7E:
                break
        seq = "\x1b[" + body.decode(errors="replace")
        params, final = body[:-1], body[-1:].decode(errors="replace")
        plain = params in (b"", b"1") or params.startswith(b"1;")  # 1;5: with Ctrl etc.
        return _KEY_NAMES[final] if final in _KEY_NAMES and plain else seq
    if intro == b"O":
        final = byte().decode(errors="replace")
        return _KEY_NAMES.get(final, "\x1bO" + final)
    return "\x1b" + intro.decode(errors="replace")


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
    options: dict[str, Any],
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
    from roll_core.envs.agents import check_task, load_agent
    from roll_core.models.loading import use_chat_template
    from roll_core.rollout.agentic import ChatFormat, Trajectory
    from roll_core.rollout.agentic.agent_episode import (
        Respond,
        expert_responder,
        play_scripted,
    )
    from roll_core.rollout.agentic.endpoint import AgentEndpoint

    program = load_agent(path, options)
    if model is not None and expert:  # the expert's text in the model's tokens and context
        tokenizer, context = _tokens_of(model)
        model = None
    elif model is not None:
        from roll_core.envs.model_policy import ModelPolicy

        player = ModelPolicy(model, max_new_tokens=max_new_tokens, temperature=temperature)
        tokenizer, context = player.tokenizer, player.context
    else:
        import tempfile

        from roll_core.models import load_tokenizer, materialize_builtin

        # the expert writes text: show it with the built-in models' ChatML tokenizer
        where = tempfile.mkdtemp(prefix="roll-debug-agent-")
        tokenizer = load_tokenizer(str(materialize_builtin("tiny-qwen3", Path(where))))
        context = 4096
    if chat_template is not None:
        use_chat_template(tokenizer, str(chat_template))
    chat = ChatFormat(tokenizer)
    respond: Respond
    if model is not None:
        player._seed = seed

        def respond(task: Any, messages: list[Any], prompt: list[int], turn: int) -> list[int]:
            return player.generate_ids(prompt, turn)[0]

    else:
        respond = expert_responder(program, chat)
    endpoint = AgentEndpoint(port=0, model=model or "expert")
    try:
        for i in range(episodes):
            player_seed = seed + i
            if model is not None:
                player._seed = player_seed
            traj = Trajectory(tag=path, group=i, seed=player_seed, index=0)
            task = check_task(program, player_seed, timeout=600.0)  # its error, told as such
            try:
                play_scripted(
                    traj,
                    program,
                    respond,
                    endpoint=endpoint,
                    chat=chat,
                    max_new_tokens=max_new_tokens,
                    max_context=context,
                    timeout=600.0,
                )
            except Exception as err:  # noqa: BLE001 - shown as the episode's end, like training
                from roll_core.envs.faults import describe_fault

                traj.status, traj.error = "error", describe_fault(err)
            _print_agent_episode(traj, tokenizer, i, episodes, task)
    finally:
        endpoint.close()


def _tokens_of(model: str) -> tuple[Any, int]:
    """A model's tokenizer and context length, without loading its weights."""
    from roll_core.models import load_tokenizer
    from roll_core.models.loading import model_config

    return load_tokenizer(model), int(model_config(model).get("max_position_embeddings") or 4096)


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
