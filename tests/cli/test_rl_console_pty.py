"""The live RL console on a real terminal: `roll train rlvr` under a pseudo-terminal (python's
pty module), as a user sees it. The bar must carry the RL metrics and the time split must be
printed above it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import yaml

from tests.conftest import ROLL, ROOT

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _run_on_a_pty(args: list[str], env: dict[str, str], timeout: float = 240) -> tuple[int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    code = proc.wait(timeout=30)
    return code, ANSI.sub("", b"".join(chunks).decode(errors="replace"))


def test_rlvr_bar_shows_reward_and_a_time_split(cli_env, tmp_path: Path) -> None:
    recipe = {
        "pipeline": "rlvr",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 64},
            "max_prompt_length": 64,
        },
        "rollout": {"n": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        "algorithm": {"preset": "grpo"},
        "trainer": {"max_steps": 3, "micro_batch_size": 4},
        "actor_train": {"num_threads": 1},
        "actor_infer": {"num_threads": 1},
        "eval": {"every_steps": None},
        "checkpoint": {"every_steps": None},
        "tracking": {"backends": ["console", "jsonl"], "time_split_every": 1},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**cli_env, "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)  # the terminal's own size (200 columns)
    code, screen = _run_on_a_pty([ROLL, "train", "rlvr", str(path), "--run-id", "pty-rl"], env)
    assert code == 0, screen
    bars = [line for line in screen.replace("\r", "\n").splitlines() if "3/3" in line]
    assert bars, screen
    assert re.search(r"reward [-0-9.e]+ +acc [0-9.e]+ +kl [-0-9.e]+ +entropy [0-9.]+", bars[-1])
    assert "━" in bars[-1]  # drawn as a bar, not plain lines
    split = re.search(r"time step 3: rollout [0-9.]+s [0-9]+%.*train [0-9.]+s [0-9]+%", screen)
    assert split, screen
    assert "run pty-rl finished" in screen
