"""`roll generate` through the real CLI: one prompt, and chat mode on piped input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROLL = str(Path(sys.executable).parent / "roll")
QUIET = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed's auto-detection warns on stdout (when imported)


def test_one_prompt_and_a_chat(roll, cli_env, tmp_path: Path) -> None:
    args = ["generate", "builtin:tiny-qwen3", "--max-new-tokens", "6", "--temperature", "1.0"]
    one = roll(*args, "What is 2 + 3?", "--seed", "3", cwd=tmp_path, env=QUIET)
    assert one.returncode == 0, one.stderr
    reply = one.stdout.removesuffix("\n")
    assert reply and one.stdout.endswith("\n")
    # chat: turn 1 is the same rendered prompt with the same seed, so the same reply; after
    # /reset the history is gone and turn 3 (seed 3 + 2) answers the bare question again.
    script = "What is 2 + 3?\nAnd times 4?\n/reset\nWhat is 2 + 3?\n/exit\nnever sent\n"
    chat = subprocess.run(
        [ROLL, *args, "--seed", "3"],
        input=script,
        env=cli_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.startswith(reply + "\n")
    assert "(conversation cleared)" in chat.stderr
    third = roll(*args, "What is 2 + 3?", "--seed", "5", cwd=tmp_path, env=QUIET)
    assert chat.stdout.endswith("\n" + third.stdout.removesuffix("\n") + "\n")


def test_bad_input(roll, tmp_path: Path) -> None:
    res = roll("generate", "not-a-run", "hi", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and "'not-a-run' is not a run" in res.stderr
    res = roll("generate", "builtin:tiny-qwen3", "hi", "--temperature", "-1", cwd=tmp_path)
    assert res.returncode == 2 and "--temperature must be >= 0" in res.stderr
    res = roll("generate", "builtin:nope", "hi", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
