"""A reward worker process: ``python -m roll_core.rewards._worker READ_FD WRITE_FD PARENT_PID``.

Protocol (frames of an 8-byte length and a pickle, see :mod:`roll_core.rewards.execution`):
the driver sends ``(sys_path, pickled_fns)`` once, the worker answers ``("ready", None)`` or
``("failed", reason)``; then each request ``(key, sample)`` gets ``("ok", RewardResult)`` or
``("error", reason)``. End of input (or the driver's death) ends the worker. The worker's
stdout and stderr are the driver's, so ``print`` in a reward function shows up there.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time


def _exit_with_parent(parent: int) -> None:
    """Exit as soon as the driver is gone, even while a reward function is stuck."""

    # Not PR_SET_PDEATHSIG: it fires when the *thread* that started us ends, and the
    # router starts workers from whichever scheduler thread needs one.
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="roll-reward-parent-watch").start()


def main(read_fd: int, write_fd: int, parent: int) -> None:
    """Serve reward requests until the driver (process ``parent``) closes the pipe."""
    _exit_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business
    from roll_core.rewards.execution import call_fn, describe_error, read_frame, warm, write_frame

    try:
        sys_path, payload = read_frame(read_fd)
    except EOFError:
        return
    sys.path[:] = list(dict.fromkeys(sys_path))
    try:
        fns = pickle.loads(payload)
        warm(fns)
    except BaseException as err:
        write_frame(write_fd, ("failed", describe_error(err)))
        return
    write_frame(write_fd, ("ready", None))
    while True:
        try:
            key, sample = read_frame(read_fd)
        except EOFError:  # the driver closed the pipe or is gone
            return
        try:
            reply: tuple[str, object] = ("ok", call_fn(fns, key, sample))
        except BaseException as err:  # a reward function must never end the worker
            reply = ("error", describe_error(err))
        try:
            write_frame(write_fd, reply)
        except Exception as err:  # e.g. an info value that cannot be pickled
            write_frame(
                write_fd, ("error", "the result cannot be sent back: " + describe_error(err))
            )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
