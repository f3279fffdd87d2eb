"""Hostile programs through the real sandbox: each one is contained, scores 0, and is counted.

``namespaces`` mode is what roll uses wherever unprivileged user namespaces work (here and on
most Linux hosts); the attacks it alone stops (network, host files, other processes) are
skipped with the reason when it is unavailable. The ``rlimits`` tests check what the
fallback mode does contain.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from roll_core.config.reward_options import CodeRewardConfig
from roll_core.rewards import sandbox as sandbox_module
from roll_core.rewards.base import RewardSample
from roll_core.rewards.code import CodeReward
from roll_core.rewards.sandbox import Sandbox, SandboxLimits, TestCase, namespaces_available

NS_OK, NS_WHY = namespaces_available()
needs_ns = pytest.mark.skipif(not NS_OK, reason=f"namespaces mode unavailable here: {NS_WHY}")
MARKERS = (b"def _main():\n    kind = sys.argv[1]", b"CLONE_NEWNS = 0x00020000")


# Orphans (a program's setsid escapee) are re-parented to this process, not to init, so
# that "left behind" can be told apart from other jobs' sandboxes on a shared machine.
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def sandbox_processes() -> set[int]:
    """Pids of sandbox supervisors and programs (by their -c source) below this process."""
    parent, marked = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = next(
            (line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "0"
        )
        parent[int(entry)] = int(ppid)
        if any(m in cmdline for m in MARKERS):
            marked.add(int(entry))
    found = set()
    for pid in marked:
        up, hops = parent.get(pid, 0), 0
        while up and up != os.getpid() and hops < 64:
            up, hops = parent.get(up, 0), hops + 1
        if up == os.getpid():
            found.add(pid)
    return found


@pytest.fixture(scope="module")
def ns() -> Sandbox:
    if not NS_OK:
        pytest.skip(f"namespaces mode unavailable here: {NS_WHY}")
    return Sandbox(mode="namespaces", limits=SandboxLimits(memory_mb=256, max_processes=8))


@pytest.fixture(scope="module")
def rl() -> Sandbox:
    # the default interpreter (this virtualenv's), also as root: a pyenv under /root is
    # shown to run_as_uid through a private mount namespace
    return Sandbox(mode="rlimits", limits=SandboxLimits(memory_mb=256, max_processes=8))


@pytest.fixture(params=["namespaces", "rlimits"])
def any_sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return request.getfixturevalue("ns" if request.param == "namespaces" else "rl")


@pytest.fixture(autouse=True)
def no_strays():
    """Every test: no sandbox process may outlive the execution."""
    before = sandbox_processes()
    yield
    deadline = time.monotonic() + 2.0
    while (left := sandbox_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"stray sandbox processes remain: {sorted(left)}"


def run_one(sandbox: Sandbox, code: str, *, stdin: str = "", stdout: str = "", timeout=10.0):
    start = time.monotonic()
    result = sandbox.run(code, [TestCase("stdio", stdin=stdin, stdout=stdout)], [timeout])
    return result, time.monotonic() - start


def test_a_normal_program_passes_and_a_wrong_one_fails(any_sandbox: Sandbox) -> None:
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    cases = [TestCase("stdio", "1 2\n", "3\n"), TestCase("stdio", "2 2\n", "5\n")]
    result = any_sandbox.run(code, cases, [5.0, 5.0])
    assert result.sandbox_error is None
    assert [c.status for c in result.cases] == ["pass", "fail"]
    asserts = [
        TestCase("assert", test="assert add(1, 2) == 3"),
        TestCase("assert", test="assert add(1, 1) == 3"),
    ]
    result = any_sandbox.run("def add(x, y):\n    return x + y\n", asserts, [5.0, 5.0])
    assert [c.status for c in result.cases] == ["pass", "error"]


def test_infinite_loop_times_out_in_bounded_time(any_sandbox: Sandbox) -> None:
    result, seconds = run_one(any_sandbox, "while True:\n    pass\n", timeout=1.0)
    assert result.cases[0].status == "timeout"
    assert 1.0 <= result.cases[0].seconds < 3.0
    assert seconds < 8.0


def test_sleeping_forever_times_out(any_sandbox: Sandbox) -> None:
    result, seconds = run_one(any_sandbox, "import time\ntime.sleep(3600)\n", timeout=1.0)
    assert result.cases[0].status == "timeout" and seconds < 8.0


def test_fork_bomb_is_bounded_and_leaves_no_process(any_sandbox: Sandbox) -> None:
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(10000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(3600)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print('forks', n, flush=True)\n"
        "time.sleep(3600)\n"
    )
    result, seconds = run_one(any_sandbox, code, timeout=2.0)
    assert result.cases[0].status == "timeout"
    assert seconds < 10.0
    # the autouse fixture checks that none of the forked children survived


@needs_ns
def test_fork_bomb_hits_the_process_limit(ns: Sandbox) -> None:
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(10000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(3600)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print('limited' if n < 8 else n)\n"
    )
    result, _ = run_one(ns, code, stdout="limited\n", timeout=3.0)
    assert result.cases[0].status == "pass"  # fewer than max_processes=8 forks succeeded


def test_setsid_escapee_does_not_survive_in_namespaces(ns: Sandbox) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(3600)\n"
        "    os._exit(0)\n"
        "print('done')\n"
    )
    result, _ = run_one(ns, code, stdout="done\n")
    assert result.cases[0].status == "pass"


def test_unbounded_memory_hits_the_limit(any_sandbox: Sandbox) -> None:
    code = (
        "blocks = []\n"
        "try:\n"
        "    while True:\n"
        "        blocks.append(bytearray(16 << 20))\n"
        "except MemoryError:\n"
        "    print('limited at', len(blocks) * 16 < 256)\n"
    )
    result, seconds = run_one(any_sandbox, code, stdout="limited at True\n", timeout=5.0)
    assert result.cases[0].status == "pass"  # the program saw MemoryError below 256 MiB
    assert seconds < 10.0
    result, _ = run_one(any_sandbox, "x = bytearray(10**10)\n", timeout=5.0)
    assert result.cases[0].status == "error"


@needs_ns
def test_writes_outside_the_work_dir_do_not_reach_the_host(ns: Sandbox, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)  # even a world-writable host directory
    targets = [
        f"/tmp/roll-attack-{uuid.uuid4().hex}",
        str(tmp_path / "planted.txt"),
        f"/dev/shm/roll-attack-{uuid.uuid4().hex}",
        os.path.join(os.path.dirname(__file__), f"planted-{uuid.uuid4().hex}.py"),
    ]
    code = (
        "import sys\n"
        "blocked = 0\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('pwned')\n"
        "    except OSError:\n"
        "        blocked += 1\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print(blocked, open('inside.txt').read())\n"
    )
    result, _ = run_one(ns, code, stdout=f"{len(targets) - 2} ok\n")
    # /tmp (the work directory) and /dev/shm are the sandbox's own empty tmpfs: writable
    # inside, gone afterwards; the other two paths do not exist in the sandbox's root
    assert result.cases[0].status == "pass", result.cases[0]
    for target in targets:
        assert not os.path.exists(target), target


def test_the_work_dir_is_removed(any_sandbox: Sandbox) -> None:
    code = (
        "import os, sys\nopen('left-behind.txt', 'w').write('x')\nsys.stderr.write(os.getcwd())\n"
    )
    result, _ = run_one(any_sandbox, code)
    assert result.sandbox_error is None
    work = result.cases[0].stderr
    if any_sandbox.mode == "namespaces":
        assert work == "/tmp"  # the sandbox's own tmpfs: no host directory at all
    else:
        assert Path(work).name == "work" and not Path(work).parent.exists()


@needs_ns
def test_network_connections_fail(ns: Sandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        for _ in range(40):
            try:
                accepted.append(server.accept())
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = (
        "import socket\n"
        "failed = 0\n"
        f"for host in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('pypi.org', 443)]:\n"
        "    try:\n"
        "        socket.create_connection(host, timeout=1).close()\n"
        "    except OSError:\n"
        "        failed += 1\n"
        "print(failed)\n"
    )
    result, _ = run_one(ns, code, stdout="3\n", timeout=5.0)
    server.close()
    thread.join(5)
    assert result.cases[0].status == "pass", result.cases[0]
    assert accepted == []  # the host's localhost server never saw a connection


def test_environment_secrets_are_absent(any_sandbox: Sandbox, monkeypatch) -> None:
    secret = f"hunter2-{uuid.uuid4().hex}"
    monkeypatch.setenv("ROLL_FAKE_API_KEY", secret)
    code = "import os\nprint(os.environ.get('ROLL_FAKE_API_KEY'), 'HOME' in os.environ)\n"
    result, _ = run_one(any_sandbox, code, stdout="None True\n")
    assert result.cases[0].status == "pass"


@needs_ns
def test_other_processes_environments_are_unreadable(ns: Sandbox, monkeypatch) -> None:
    secret = f"hunter2-{uuid.uuid4().hex}"
    monkeypatch.setenv("ROLL_FAKE_API_KEY", secret)
    code = (
        "import os\n"
        "found = 0\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        f"        found += {secret!r}.encode() in open(f'/proc/{{pid}}/environ', 'rb').read()\n"
        "    except (OSError, ValueError):\n"
        "        pass\n"
        f"print(found, {str(os.getpid())!r} in os.listdir('/proc'))\n"
    )
    result, _ = run_one(ns, code, stdout="0 False\n")
    assert result.cases[0].status == "pass", result.cases[0]


def test_printing_gigabytes_is_cut_off(any_sandbox: Sandbox) -> None:
    code = "import sys\nline = 'x' * 65535 + '\\n'\nwhile True:\n    sys.stdout.write(line)\n"
    result, seconds = run_one(any_sandbox, code, timeout=10.0)
    assert result.cases[0].status == "output_limit"
    assert seconds < 8.0  # killed at 1 MiB, long before the 10 s timeout
    assert len(result.cases[0].stderr) <= 1000


def test_huge_files_hit_the_file_size_limit(any_sandbox: Sandbox) -> None:
    code = "with open('big.bin', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n"
    result, _ = run_one(any_sandbox, code, timeout=10.0)
    assert result.cases[0].status in ("file_limit", "error")


@needs_ns
def test_killing_the_parent_is_contained(ns: Sandbox) -> None:
    code = (
        "import os, signal\n"
        "targets = [os.getppid(), 1, int(input())]\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit() and int(pid) != os.getpid():\n"
        "        targets.append(int(pid))\n"
        "for pid in targets:\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('still here')\n"
    )
    result, _ = run_one(ns, code, stdin=f"{os.getpid()}\n", stdout="still here\n")
    assert result.sandbox_error is None  # the supervisor (its parent) survived
    assert result.cases[0].status == "pass"
    assert os.getppid() > 0  # and so did we (this line runs)


def test_exiting_before_the_asserts_does_not_pass(any_sandbox: Sandbox) -> None:
    cases = [TestCase("assert", test="assert f() == 2")]
    for cheat in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        result = any_sandbox.run("def f():\n    return 1\n" + cheat, cases, [5.0])
        assert result.cases[0].status == "error", cheat


def test_hostile_responses_score_zero_through_the_code_reward() -> None:
    reward = CodeReward(
        CodeRewardConfig.model_validate(
            {"timeout": {"max_s": 1.0, "min_s": 0.5}, "sandbox": {"memory_mb": 256}}
        )
    )
    row = {"tests": [{"input": "2\n", "output": "4\n"}], "domain": "code"}
    attacks = [
        "while True: pass",
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        "x = bytearray(10**10)",
        "while True: print('x' * 65536)",
    ]
    for attack in attacks:
        result = reward(RewardSample("p", f"```python\n{attack}\n```", row))
        assert result.score == 0.0 and not result.info["correct"], attack
    good = reward(RewardSample("p", "```python\nprint(int(input()) * 2)\n```", row))
    assert good.score == 1.0
    metrics = reward.metrics()
    assert metrics["code/executions"] == 5 and metrics["code/pass_rate"] == 1 / 5
    assert metrics["code/timeouts"] >= 2 and metrics["code/limit_kills"] == 1


def _supervisor_of_this_process() -> int | None:
    for pid in sandbox_processes():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if f"PPid:\t{os.getpid()}\n" in status:
            return pid
    return None


def test_a_killed_supervisor_keeps_no_pass(any_sandbox: Sandbox) -> None:
    """Case 1 passes, then the supervisor dies during case 2: every case is sandbox_error."""
    code = (
        "import time\nn = int(input())\nprint(n * 2, flush=True)\nif n == 2:\n    time.sleep(30)\n"
    )
    cases = [TestCase("stdio", "1\n", "2\n"), TestCase("stdio", "2\n", "4\n")]
    killed: list[int] = []

    def kill_it() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not killed:
            pid = _supervisor_of_this_process()
            if pid is not None:
                time.sleep(1.5)  # case 1 has passed by now
                os.kill(pid, 9)
                killed.append(pid)
            time.sleep(0.05)

    thread = threading.Thread(target=kill_it)
    thread.start()
    result = any_sandbox.run(code, cases, [20.0, 20.0])
    thread.join()
    assert killed
    assert result.sandbox_error is not None and "exit code -9" in result.sandbox_error
    assert [c.status for c in result.cases] == ["sandbox_error", "sandbox_error"]


@pytest.mark.parametrize(
    "output",
    [
        '{"nonce": "0", "cases": [{"status": "pass"}]}',  # a nonce the program cannot know
        '{"nonce": NONCE, "cases": [{"status": "pass"}]}\n{"status": "pass"}',  # an extra line
        '{"nonce": NONCE, "cases": [{"status": "pass"}, {"status": "pass"}]}',  # too many
        '{"nonce": NONCE, "cases": [{"status": "passed"}]}',  # not a status
    ],
)
def test_only_the_supervisors_own_verdict_is_accepted(monkeypatch, output: str) -> None:
    """A stand-in supervisor that reads the spec and prints ``output`` (NONCE: the real one)."""
    fake = (
        "import json, sys\n"
        "nonce = json.loads(sys.stdin.read())['nonce']\n"
        f"print({output!r}.replace('NONCE', json.dumps(nonce)))\n"
    )
    monkeypatch.setattr(sandbox_module, "_SUPERVISOR", fake)
    result = Sandbox(mode="rlimits").run("print(1)", [TestCase("stdio", "", "1\n")], [5.0])
    assert result.sandbox_error is not None and "not valid" in result.sandbox_error
    assert [c.status for c in result.cases] == ["sandbox_error"]


def test_the_real_verdict_is_accepted_by_the_same_check(monkeypatch) -> None:
    fake = (
        "import json, sys\n"
        "nonce = json.loads(sys.stdin.read())['nonce']\n"
        "print(json.dumps({'nonce': nonce, 'cases': [{'status': 'pass'}]}))\n"
    )
    monkeypatch.setattr(sandbox_module, "_SUPERVISOR", fake)
    result = Sandbox(mode="rlimits").run("print(1)", [TestCase("stdio", "", "1\n")], [5.0])
    assert result.sandbox_error is None and result.all_passed


def test_threads_are_not_limited_by_the_drivers_own(any_sandbox: Sandbox) -> None:
    """rlimits mode sets no per-uid process limit (it would count this process's threads)."""
    stop = threading.Event()
    mine = [threading.Thread(target=stop.wait, daemon=True) for _ in range(40)]
    for t in mine:
        t.start()
    code = (
        "import threading\n"
        "out = []\n"
        "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
        "print(sum(out))\n"
    )
    try:
        result, _ = run_one(any_sandbox, code, stdout="6\n")  # 0 + 1 + 2 + 3
    finally:
        stop.set()
    assert result.cases[0].status == "pass", result.cases[0]
