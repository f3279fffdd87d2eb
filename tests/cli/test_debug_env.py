"""`roll debug-env` through the real CLI: random, model, replay, errors, and a human at a pty."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from roll_core.envs import make_env

ROLL = str(Path(sys.executable).parent / "roll")
CORRIDOR = "######/#@$_.#/######"  # push the box Right twice onto the target


def _run(
    args: list[str], env: dict[str, str], *, stdin: str | None = None, cwd: Path | None = None
):
    """Run `roll` with stdin from a pipe (never the terminal pytest may be attached to)."""
    return subprocess.run(
        [ROLL, *args],
        input=stdin or "",
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_random_policy_record_and_replay(cli_env: dict[str, str], tmp_path: Path) -> None:
    record = tmp_path / "sokoban.jsonl"
    res = _run(
        [
            "debug-env",
            "sokoban",
            "--policy",
            "random",
            "--seed",
            "3",
            "--episodes",
            "2",
            "max_steps=6",
            "--record",
            str(record),
        ],
        cli_env,
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for part in (
        "episode 1/2 · sokoban · seed 3 · random",
        "episode 2/2",
        "system prompt",
        "turn 1 · prompt",
        "turn 1 · response",
        "reward -0.10",
        "final observation",
        "2 episodes: success rate",
    ):
        assert part in out, part
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [e["seed"] for e in lines] == [3, 4]
    assert all(e["env"] == "sokoban" and e["options"]["max_steps"] == 6 for e in lines)
    assert all(1 <= e["length"] <= 6 for e in lines)
    # the recorded room is the room the library makes for that seed
    assert lines[0]["initial_observation"] == make_env("sokoban", max_steps=6).reset(3)[0]

    res = _run(["debug-env", "sokoban", "--replay", str(record)], cli_env)
    assert res.returncode == 0, res.stderr
    assert "every observation and reward reproduced" in res.stdout
    assert "episode 2/2 · sokoban · seed 4 · replay" in res.stdout  # every recorded episode

    res = _run(["debug-env", "frozen_lake", "--replay", str(record)], cli_env)
    assert res.returncode == 2
    assert "was recorded from env 'sokoban', not 'frozen_lake'" in res.stderr
    assert f"roll debug-env sokoban --replay {record}" in res.stderr
    assert "Traceback" not in res.stderr

    res = _run(["debug-env", "sokoban", "--replay", str(record), "max_steps=9"], cli_env)
    assert res.returncode == 2 and "recorded options" in res.stderr


def test_model_policy_with_a_builtin_model(cli_env: dict[str, str], tmp_path: Path) -> None:
    record = tmp_path / "lake.jsonl"
    res = _run(
        [
            "debug-env",
            "frozen_lake",
            "max_steps=2",
            "--policy",
            "model",
            "--model",
            "builtin:tiny-qwen3",
            "--max-new-tokens",
            "8",
            "--record",
            str(record),
        ],
        cli_env,
    )
    assert res.returncode == 0, res.stderr
    assert "model: builtin:tiny-qwen3" in res.stdout and "turn 2 · response" in res.stdout
    assert "8 tokens, length" in res.stdout  # an untrained model talks until max_new_tokens
    (episode,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert episode["policy"] == "model" and episode["model"] == "builtin:tiny-qwen3"
    assert [t["policy_info"]["response_tokens"] for t in episode["turns"]] == [8, 8]
    assert episode["length"] == 2 and episode["turns"][1]["truncated"]
    # the random-init model is an invalid-action generator: each costs the format penalty
    assert all(not t["info"]["action_is_valid"] for t in episode["turns"])
    res = _run(["debug-env", "frozen_lake", "--replay", str(record)], cli_env)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sokoban"], "stdin is not a terminal"),
        (["sokobn", "--policy", "random"], "unknown env 'sokobn'. Did you mean 'sokoban'?"),
        (
            ["sokoban", "widht=7", "--policy", "random"],
            "unknown option 'widht' (did you mean 'width'?)",
        ),
        (["sokoban", "--policy", "model"], "--policy model needs --model"),
        (
            ["sokoban", "--policy", "random", "--model", "x"],
            "--model is only used with --policy model",
        ),
        (["sokoban", "--replay", "missing.jsonl"], "recording missing.jsonl does not exist"),
        (
            ["sokoban", "--replay", "a.jsonl", "--record", "b.jsonl"],
            "takes no --policy, --model or --record",
        ),
        (
            ["sokoban", "--policy", "random", "--record", "/nonexistent-dir/x.jsonl"],
            "cannot write the recording /nonexistent-dir/x.jsonl",
        ),
        (
            ["sokoban", "--options", "obs_mode=image"],
            "roll debug-env sokoban obs_mode=image",
        ),
        (
            ["frozen_lake", "obs_mode=image", "--model", "builtin:tiny-qwen3"],
            "env frozen_lake shows pictures (obs_mode=image)",
        ),
        (["tool_use", "--policy", "expert"], "env tool_use has no solver"),
    ],
)
def test_bad_input_is_a_clear_error(cli_env: dict[str, str], args: list[str], message: str) -> None:
    res = _run(["debug-env", *args], cli_env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "error:" in res.stderr and message in res.stderr
    assert "Traceback" not in res.stderr
    if args == ["sokoban"]:
        assert "--policy random" in res.stderr and "--policy model --model" in res.stderr


def test_expert_policy_plays_the_solver(cli_env: dict[str, str]) -> None:
    res = _run(["debug-env", "sokoban", "--policy", "expert", "--episodes", "5"], cli_env)
    assert res.returncode == 0, res.stderr
    assert "episode 1/5 · sokoban · seed 0 · expert" in res.stdout
    assert "5 episodes: success rate 100%" in res.stdout
    res = _run(["debug-env", "sokoban", f"room={CORRIDOR}", "--policy", "expert"], cli_env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("You pushed a box Right") == 2


def test_human_from_piped_stdin(cli_env: dict[str, str]) -> None:
    res = _run(
        ["debug-env", "sokoban", f"room={CORRIDOR}", "--policy", "human"],
        cli_env,
        stdin="dance\nRight\n<answer>right</answer>\n",
    )
    assert res.returncode == 0, res.stderr
    assert "invalid action: 'dance' is not one of Up, Down, Left, Right" in res.stdout
    # -0.1 (format penalty) - 0.1 (push) + 10.9 (box on target, solved) = 10.7
    assert "episode 1: success, return +10.70, 3 turns" in res.stdout


def test_image_observations_are_saved_printed_and_replayed(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    record = tmp_path / "images.jsonl"
    args = ["debug-env", "sokoban", f"room={CORRIDOR}", "obs_mode=image", "--policy", "human"]
    res = _run([*args, "--record", str(record)], cli_env, stdin="Right\nRight\n", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "episode 1: success, return +10.80, 2 turns" in res.stdout
    # one picture per turn's prompt and the final observation, under runs/debug-env/ENV-TIME/
    paths = re.findall(r"image 84x42: (\S+)", res.stdout)
    assert [Path(p).name for p in paths] == [
        "episode01-turn01.png",
        "episode01-turn02.png",
        "episode01-final.png",
    ]
    assert all(p.startswith("runs/debug-env/sokoban-") for p in paths)
    assert "\x1b" not in res.stdout  # piped: paths only, no image escape codes
    from PIL import Image

    final = Image.open(tmp_path / paths[-1]).convert("RGB")
    # the box on the target at cell (row 1, col 4) of 14 px: brown centre, green border
    assert final.getpixel((4 * 14 + 7, 14 + 7)) == (160, 95, 30)
    assert final.getpixel((4 * 14, 14)) == (60, 190, 90)
    assert final.getpixel((3 * 14 + 7, 14 + 7)) == (40, 80, 220)  # you, one cell left of it

    (episode,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert episode["initial_images"][0].startswith("sha1:")
    res = _run(["debug-env", "sokoban", "--replay", str(record)], cli_env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    episode["turns"][0]["observation_images"] = ["sha1:0"]  # a picture that differs
    record.write_text(json.dumps(episode) + "\n")
    res = _run(["debug-env", "sokoban", "--replay", str(record)], cli_env, cwd=tmp_path)
    assert res.returncode == 2 and "diverged at the turn 1 observation's images" in res.stderr


def test_user_env_by_dotted_path(cli_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "coin_env.py").write_text(
        textwrap.dedent(
            """
            from roll_core.envs import TextEnv, Transition, parse_choice

            class Coin(TextEnv):
                instructions = "Guess heads or tails."
                def on_reset(self, rng):
                    self.coin = ["heads", "tails"][int(rng.integers(2))]
                    return "I flipped a coin.", {}
                def parse_action(self, text):
                    return parse_choice(text, {"heads": "heads", "tails": "tails"})
                def on_step(self, action):
                    won = action == self.coin
                    return Transition(f"It was {self.coin}.", float(won), True, {"success": won})
                def render(self):
                    return "a coin"
                def valid_actions(self):
                    return ["heads", "tails"]
            """
        )
    )
    res = _run(
        ["debug-env", "coin_env:Coin", "--policy", "random", "--episodes", "4"],
        cli_env,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert "episode 4/4 · coin_env:Coin" in res.stdout and "4 episodes: success rate" in res.stdout


# ---- a human at a real terminal ------------------------------------------------------------
ARROWS = {"Up": b"\x1b[A", "Down": b"\x1b[B", "Right": b"\x1b[C", "Left": b"\x1b[D"}
PROMPT = b"move (arrow keys"


class _Pty:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [ROLL, *args], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
        )
        os.close(slave)
        self.seen = b""
        self._pos = 0

    def expect(self, token: bytes, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while token not in self.seen[self._pos :]:
            if time.monotonic() > end or self.proc.poll() is not None and not self._read(0.1):
                raise AssertionError(
                    f"no {token!r} in: {self.seen[-800:].decode(errors='replace')}"
                )
            self._read(0.1)
        self._pos = self.seen.index(token, self._pos) + len(token)

    def _read(self, wait: float) -> bool:
        if not select.select([self.master], [], [], wait)[0]:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:
            return False
        self.seen += data
        return bool(data)

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def finish(self, timeout: float = 60) -> str:
        self.proc.wait(timeout=timeout)
        while self._read(0.2):
            pass
        os.close(self.master)
        return self.seen.decode(errors="replace")


def test_human_plays_sokoban_with_arrow_keys_in_a_terminal(cli_env: dict[str, str]) -> None:
    env = make_env("sokoban")
    env.reset(5)
    solution = env.solve()
    assert solution and len(solution) >= 2

    term = _Pty(["debug-env", "sokoban", "--seed", "5"], {**cli_env, "TERM": "xterm"})
    term.expect(PROMPT)
    term.send(b"j")  # a key that is no arrow starts a typed action ...
    time.sleep(0.3)
    term.send(b"ump\r")  # ... finished with Enter: invalid, costs the format penalty
    term.expect(b"invalid action: 'jump'")
    for move in solution:
        term.expect(PROMPT)
        term.send(ARROWS[move])
    output = term.finish()
    assert term.proc.returncode == 0, output
    assert "every box is on a target: solved!" in output.lower()
    # -0.1 (jump) - 0.1 per move before the last + 10.9 (box on target + solved) = 10.9 - 0.1 n
    assert f"episode 1: success, return +{10.9 - 0.1 * len(solution):.2f}" in output
    assert f"{len(solution) + 1} turns" in output
    assert "^[[" not in output  # arrow keys were read, not echoed


def test_image_observations_are_drawn_inline_in_kitty(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    images = tmp_path / "pics"
    term = _Pty(
        ["debug-env", "frozen_lake", "map=SF/FG", "obs_mode=image", "max_steps=3"]
        + ["--policy", "random", "--image-dir", str(images)],
        {**cli_env, "TERM": "xterm-kitty"},
    )
    term.expect(b"1 episode: ")  # read as it prints (a full pty would block the command)
    output = term.finish()
    assert term.proc.returncode == 0, output
    assert f"image 28x28: {images}/episode01-turn01.png" in output
    assert "\x1b_Ga=T,f=100,m=0;iVBORw0KGgo" in output  # a PNG through kitty's protocol
    assert output.count("\x1b_Ga=T") == len(list(images.glob("*.png"))) >= 2


def test_human_quits_with_q(cli_env: dict[str, str]) -> None:
    term = _Pty(["debug-env", "frozen_lake", "--episodes", "3"], {**cli_env, "TERM": "xterm"})
    term.expect(PROMPT)
    term.send(ARROWS["Right"])
    term.expect(PROMPT)
    term.send(b"q")
    output = term.finish()
    assert term.proc.returncode == 0, output
    assert "episode 1: quit, return +0.00, 1 turn" in output and "1 turns" not in output
    assert "episode 2/3" not in output and "1 episode: " in output


def test_human_keys_pgup_delete_backspace_and_a_paste(cli_env: dict[str, str]) -> None:
    term = _Pty(["debug-env", "sokoban", "--seed", "5"], {**cli_env, "TERM": "xterm"})
    term.expect(PROMPT)
    term.send(b"\x1b[5~")  # PgUp and Delete at the move prompt: read whole and ignored,
    term.send(b"\x1b[3~")  # so no `~` becomes part of an action
    time.sleep(0.3)
    term.send(b"x")  # starts a typed action, edited by readline ...
    term.expect(b"action> ")
    term.send(b"\x7f")  # ... whose first character Backspace erases
    time.sleep(0.3)
    term.send(b"Lefx\x7ft\r")
    term.expect(b"action Left")
    term.expect(PROMPT)
    term.send(b"Right\r")  # a paste: one write, echoed and sent with its Enter
    term.expect(b"action Right")
    term.expect(PROMPT)
    term.send(b"q")
    output = term.finish()
    assert term.proc.returncode == 0, output
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output)  # without the colour codes
    assert "quits)> Right" in plain  # the pasted text was shown where it was typed
    assert "invalid action:" not in output and "~" not in output
    assert "episode 1: quit" in output and "2 turns" in output


def test_options_lists_types_and_defaults(cli_env: dict[str, str]) -> None:
    res = _run(["debug-env", "frozen_lake", "--options"], cli_env)
    assert res.returncode == 0, res.stderr
    lines = {line.split("│")[1].strip(): line for line in res.stdout.splitlines() if "│" in line}
    assert "size" in lines and "int" in lines["size"] and "4" in lines["size"]
    assert "is_slippery" in lines and "bool" in lines["is_slippery"]


def test_help_lists_the_keys(cli_env: dict[str, str]) -> None:
    res = _run(["debug-env", "--help"], cli_env)
    assert res.returncode == 0, res.stderr
    for text in ("arrow keys:", "Backspace, Delete", "paste:", "q, Ctrl-D:", "--options"):
        assert text in res.stdout, text


def test_an_env_that_raises_is_reported_as_the_env_s_error(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "bad_env.py").write_text(
        textwrap.dedent(
            """
            import time
            from roll_core.envs import TextEnv

            class Bad(TextEnv):
                def on_reset(self, rng):
                    return "start", {}
                def parse_action(self, text):
                    return text
                def on_step(self, action):
                    if action == "hang":
                        time.sleep(60)
                    raise KeyError("no such lever: " + action)
                def render(self):
                    return "bad"
            """
        )
    )
    res = _run(
        ["debug-env", "bad_env:Bad", "--policy", "human"], cli_env, cwd=tmp_path, stdin="pull\n"
    )
    err = " ".join(res.stderr.split())
    assert res.returncode == 1, res.stderr
    assert "bug in roll" not in err
    assert "env bad_env:Bad raised an exception in step(): KeyError: 'no such lever: pull'" in err
    assert "(at bad_env.py:13, in on_step)" in err
    start = time.monotonic()
    res = _run(
        ["debug-env", "bad_env:Bad", "--policy", "human", "--step-timeout", "0.5"],
        cli_env,
        cwd=tmp_path,
        stdin="hang\n",
    )
    assert res.returncode == 1 and time.monotonic() - start < 30, res.stderr
    assert "step() did not return within 0.5s" in " ".join(res.stderr.split())


def test_free_text_env_lines_are_edited_with_readline(cli_env: dict[str, str]) -> None:
    term = _Pty(["debug-env", "tool_use"], {**cli_env, "TERM": "xterm"})
    term.expect(b"action (Enter to send, Ctrl-D quits)> ")
    # type; Left past `</answer>`, Backspace the stray `y`; Left twice, Delete the stray `x`;
    # End, Enter
    term.send(b"<answer>4x2y</answer>")
    time.sleep(0.2)
    term.send(b"\x1b[D" * 9 + b"\x7f" + b"\x1b[D" * 2 + b"\x1b[3~" + b"\x1b[F" + b"\r")
    term.expect(b"reward")
    term.send(b"\x04")  # Ctrl-D quits
    output = term.finish()
    assert term.proc.returncode == 0, output
    assert "<answer>42</answer>" in output, output[-2000:]


AGENT = f"agent:{Path(__file__).resolve().parents[2] / 'examples/agents/calculator_agent.py'}:run"
TOOL_TEMPLATE = str(Path(__file__).resolve().parents[2] / "examples/agents/chatml-tools.jinja")


def test_agent_program_played_by_its_expert(cli_env: dict[str, str]) -> None:
    args = ["debug-env", AGENT, "low=2", "high=9", "--policy", "expert"]
    res = _run([*args, "--chat-template", TOOL_TEMPLATE], cli_env)
    assert res.returncode == 0, res.stderr
    assert "task {'question': '8*8', 'answer': 64}" in res.stdout
    assert '{"name": "calc", "arguments": {"x": "8*8"}}' in res.stdout  # call 1: the tool call
    assert "<|im_start|>tool\n64<|im_end|>" in res.stdout  # call 2 sees the tool's result
    assert "status done · reward 1 · success True" in res.stdout
    res = _run(["debug-env", AGENT, "--policy", "random"], cli_env)
    assert res.returncode == 2 and "--policy model or --policy expert" in res.stderr


@pytest.mark.slow
def test_agent_program_played_by_a_model(cli_env: dict[str, str]) -> None:
    args = ["debug-env", AGENT, "--policy", "model", "--model", "builtin:tiny-qwen3"]
    res = _run([*args, "--chat-template", TOOL_TEMPLATE, "--max-new-tokens", "8"], cli_env)
    assert res.returncode == 0, res.stderr
    assert "call 1 · 85 prompt tokens" in res.stdout and "status done · reward 0" in res.stdout


@pytest.mark.slow
def test_agent_expert_shown_in_the_recipe_models_tokens_and_context(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """--policy expert --model M: the expert's episode in M's tokenizer (the real Qwen
    vocabulary and Qwen3 template here) and M's context (1,024), not the built-in byte-level
    tokenizer's 4,096 bytes: the prompt counts are Qwen token counts."""
    from tests.qwen_real import write_model

    model = write_model(tmp_path / "qwen", template="qwen3")
    args = ["debug-env", AGENT, "low=2", "high=9", "--policy", "expert", "--model", str(model)]
    res = _run(args, cli_env)
    assert res.returncode == 0, res.stderr
    assert "status done · reward 1 · success True" in res.stdout
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples/agents"))
    from calculator_agent import TOOLS

    messages = [{"role": "system", "content": "Use calc."}, {"role": "user", "content": "8*8"}]
    text = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    n = len(tok.encode(text, add_special_tokens=False))
    assert n < len(text.encode()) / 2  # Qwen tokens, not bytes
    assert f"call 1 · {n} prompt tokens" in res.stdout
