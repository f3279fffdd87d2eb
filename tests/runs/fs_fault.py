"""Run the real `roll` CLI with a filesystem fault injected at the write call (a test double).

    python tests/runs/fs_fault.py ERRNO_NAME NAME_PART N  roll-args...

Every `open()` of a file whose name contains NAME_PART returns a file whose write raises
`OSError(ERRNO_NAME)` from the N-th such write on (counted over all those files), as a full
disk (ENOSPC) or a read-only remount (EROFS) would. We run as root in CI, where chmod does not
stop writes, so the fault is injected rather than made with permissions.
"""

from __future__ import annotations

import builtins
import errno
import os
import sys
from typing import Any


def main() -> None:
    code = getattr(errno, sys.argv[1])
    part, first = sys.argv[2], int(sys.argv[3])
    real_open = builtins.open
    writes = {"n": 0}

    class Faulty:
        def __init__(self, f: Any) -> None:
            self._f = f

        def write(self, data: Any) -> int:
            writes["n"] += 1
            if writes["n"] >= first:
                raise OSError(code, os.strerror(code))
            return self._f.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._f, name)

        def __enter__(self) -> Faulty:
            return self

        def __exit__(self, *exc: Any) -> None:
            self._f.close()

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and part in os.fspath(file) and "r" not in mode:
            return Faulty(f)
        return f

    builtins.open = fake_open
    sys.argv = ["roll", *sys.argv[4:]]
    from roll_cli.main import main as roll_main

    roll_main()


if __name__ == "__main__":
    main()
