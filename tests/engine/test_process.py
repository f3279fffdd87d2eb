"""A rank in its own process (roll_core/engine/process.py) never outlives its driver: a driver
killed by SIGKILL, which runs no code to close its ranks, takes them with it, even a rank in
the middle of a long call. The case runs a small driver script in a subprocess, kills it and
watches its ranks' pids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import os, threading, time
from roll_core.engine.process import ProcessHandle

class Sleeper:  # what ProcessHandle needs of a worker: keyword settings and `call`
    def __init__(self, **kwargs):
        pass

    def call(self, method, *args):
        return os.getpid() if method == "pid" else time.sleep(*args)

def start():
    handles.append(ProcessHandle(Sleeper, {"rank": len(handles)}, env={}))
    pids.append(handles[-1].submit("pid").result(timeout=120))  # up and running

handles, pids = [], []
start()  # from the main thread: the kernel's parent-death signal
t = threading.Thread(target=start)  # from a thread that ends before the driver dies
t.start()
t.join()
for h in handles:
    h.submit("nap", 600)  # busy, not waiting on the driver's pipe
time.sleep(1.0)
print(*pids, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_a_driver_killed_by_sigkill() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE, text=True
    )
    ranks: list[int] = []
    try:
        assert driver.stdout is not None
        ranks = [int(pid) for pid in driver.stdout.readline().split()]
        # alive while the driver is: the end of the thread that started rank 1 did not end it
        assert len(ranks) == 2 and all(map(_alive, ranks)) and driver.poll() is None
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 5.0  # rank 1's watch polls every 0.5 s
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [r for r in ranks if _alive(r)], "a rank outlived its driver by 5 s"
    finally:
        driver.kill()
        driver.wait(timeout=30)
        for rank in ranks:  # a failed run of this test leaves no orphan
            if _alive(rank):
                os.kill(rank, signal.SIGKILL)
