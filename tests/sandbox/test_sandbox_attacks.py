"""Hostile commands through the real local sandbox: each one is contained.

Run as root here (commands become ``nobody`` inside namespaces); the last test runs this
whole file again as an unprivileged user (uid 65534), where the machine allows it. The
namespace attacks are skipped with the reason where user namespaces do not work.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import site
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from roll_core.errors import SandboxError
from roll_core.sandbox import LocalBackend, SandboxSpec
from roll_core.sandbox.base import Tunnel
from roll_core.sandbox.local import namespaces_work

NS_OK, NS_WHY = namespaces_work(sys.executable, True, 65534)
pytestmark = pytest.mark.skipif(not NS_OK, reason=f"namespaces unavailable here: {NS_WHY}")
MARK = f"SECRET{uuid.uuid4().hex[:12]}"  # only in the task store's files
# where a search costs little (not the read-only /usr and interpreter trees: they are the
# host's own, shown on purpose)
SEARCHED = "/tmp /workspace /root /home /var /etc /opt /mnt /srv /run /dev"
SPEC = SandboxSpec(memory_mb=512, max_processes=32, max_file_mb=8, max_output_bytes=4096)


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A task store: the repository the agent gets, and the secrets next to it."""
    repo = tmp_path / "task" / "repo"
    repo.mkdir(parents=True)
    (repo / "lib.py").write_text("def f():\n    return 1\n")
    (tmp_path / "task" / "hidden_test.py").write_text(f"{MARK}_HIDDEN_TEST = 1\n")
    (tmp_path / "task" / "fix.patch").write_text(f"{MARK}_REFERENCE_FIX\n")
    return tmp_path / "task"


@pytest.fixture
def box(store: Path):
    backend = LocalBackend(max_concurrent=2, root=store.parent / "boxes")
    with backend.create(store / "repo", SPEC) as sandbox:
        yield sandbox


def test_hidden_tests_and_the_reference_fix_are_unreachable(box, store: Path) -> None:
    commands = [
        f"cat {store}/hidden_test.py {store}/fix.patch",
        f"ls {store} {store.parent}",
        f"grep -rs {MARK} {SEARCHED} | head",
        "cat /proc/1/root" + str(store) + "/fix.patch",
        "cat ../task/fix.patch ../fix.patch ../../fix.patch",
    ]
    for command in commands:
        result = box.exec(command, timeout=20)
        assert MARK not in result.output() and "fix.patch\n" not in result.output(), command


def test_writes_outside_the_workspace_do_not_reach_the_host(box, store: Path) -> None:
    name = f"roll-attack-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"/dev/shm/{name}", f"{store}/{name}", f"/usr/{name}"]
    box.exec("; ".join(f"echo x > {t}" for t in targets) + f"; echo y > {store.parent}/x", 10)
    for target in targets:
        assert not os.path.exists(target)
    assert not (store.parent / "x").exists()
    assert box.exec(f"echo ok > {name} && cat {name}", 10).stdout == "ok\n"


def test_no_network_not_even_the_hosts_loopback(box) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "for host in ('127.0.0.1', '1.1.1.1', 'example.com'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port} if host[0] == '1' else 80), timeout=2)\n"
        "        print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('refused', host, e)\n"
    )
    result = box.exec(f"python3 -c {shlex.quote(code)}", timeout=20)
    assert "CONNECTED" not in result.stdout and result.stdout.count("refused") == 3
    with pytest.raises(OSError):
        server.accept()
    server.close()


def test_the_way_out_reaches_only_its_target(box) -> None:
    """A tunnel (a harness's way to its endpoint) reaches its one target and nothing else:
    not the target's own port, not another host port, not the network; the socket behind it
    is read-only, relays only to the target, and is gone when the command ends."""
    servers = []
    for _ in range(2):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        servers.append(server)
    target, other = (s.getsockname()[1] for s in servers)
    answered = []

    def answer() -> None:  # the target: says who it is to each connection
        servers[0].settimeout(20)
        with contextlib.suppress(OSError):
            while True:
                conn, _ = servers[0].accept()
                with conn:
                    answered.append(conn.recv(64))
                    conn.sendall(b"TARGET")

    threading.Thread(target=answer, daemon=True).start()
    code = (
        "import socket, os\n"
        "def talk(addr, family=socket.AF_INET):\n"
        "    try:\n"
        "        s = socket.socket(family); s.settimeout(3); s.connect(addr)\n"
        "        s.sendall(b'hello'); return s.recv(64).decode() or 'EOF'\n"
        "    except OSError as e:\n"
        "        return 'refused'\n"
        "print('tunnel', talk(('127.0.0.1', 18080)))\n"
        f"print('target', talk(('127.0.0.1', {target})))\n"
        f"print('other', talk(('127.0.0.1', {other})))\n"
        "print('outside', talk(('1.1.1.1', 80)))\n"
        "print('socket', talk('/run/roll/way-out.sock', socket.AF_UNIX))\n"
        "try:\n"
        "    open('/run/roll/planted', 'w'); print('planted WROTE')\n"
        "except OSError:\n"
        "    print('planted read-only')\n"
    )
    tunnel = Tunnel(18080, ("127.0.0.1", target))
    result = box.exec(f"python3 -c {shlex.quote(code)}", timeout=30, tunnel=tunnel)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines == {
        "tunnel": "TARGET",
        "target": "refused",
        "other": "refused",
        "outside": "refused",
        "socket": "TARGET",
        "planted": "read-only",
    }, result.output()
    assert answered == [b"hello", b"hello"] and box.relay.connections == 2
    assert not box.relay.path.exists()  # closed with the command
    servers[1].settimeout(0.2)
    with pytest.raises(OSError):
        servers[1].accept()  # nothing ever reached the other port
    for server in servers:
        server.close()
    # the next command has no way out at all
    code = "import socket; socket.create_connection(('127.0.0.1', 18080), 2)"
    assert box.exec(f"python3 -c {shlex.quote(code)}", 20).exit_code != 0


def test_another_episodes_workspace_is_unreachable(store: Path) -> None:
    backend = LocalBackend(max_concurrent=2, root=store.parent / "boxes")
    with backend.create(store / "repo", SPEC) as a, backend.create(store / "repo", SPEC) as b:
        b.write_file("secret.txt", "SECRET_OF_B\n")
        for command in [
            f"cat {b.workspace}/secret.txt",
            f"ls {backend.root}",
            f"grep -rs SECRET_OF_B {SEARCHED}",
        ]:
            assert "SECRET_OF_B" not in a.exec(command, timeout=20).output(), command
        assert "SECRET_OF_B" in b.exec("cat secret.txt", timeout=10).stdout


def test_a_fork_bomb_is_bounded_and_leaves_nothing(box) -> None:
    marker = f"bomb{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    result = box.exec(f"b() {{ exec -a {marker} sleep 300 & b | b & }}; b; sleep 30", timeout=3)
    assert time.monotonic() - start < 10
    assert result.timed_out  # the bomb's sleepers kept the command alive until its timeout
    assert processes_with(marker) == []


def test_sleeping_forever_times_out(box) -> None:
    start = time.monotonic()
    result = box.exec("sleep 1000", timeout=1)
    assert result.timed_out and time.monotonic() - start < 5


def test_a_cpu_hog_hits_the_cpu_limit() -> None:
    # 1 CPU second: the loop is killed by RLIMIT_CPU long before the wall-clock timeout
    spec = SandboxSpec(cpu_s=1)
    src = Path(__file__).parent
    with LocalBackend().create(src, spec) as box:
        result = box.exec("python3 -c 'while True: pass'", timeout=30)
    assert result.timed_out and result.seconds < 10


def test_flooding_output_is_cut_and_bounded(box) -> None:
    start = time.monotonic()
    result = box.exec("yes SPAM", timeout=30)
    assert result.truncated and time.monotonic() - start < 15
    assert len(result.stdout) < 4096 + 100 and "bytes of output cut" in result.stdout
    result = box.exec("seq 1 5000", timeout=30)  # over the cap, under a flood: finishes
    assert result.ok and result.truncated
    assert result.stdout.startswith("1\n2\n") and result.stdout.endswith("4999\n5000\n")


def test_memory_and_file_size_limits(box) -> None:
    result = box.exec("python3 -c 'x = bytearray(2 << 30)'", timeout=20)
    assert result.exit_code != 0 and "MemoryError" in result.stderr
    result = box.exec("head -c 50M /dev/zero > big; ls -la big", timeout=20)
    assert os.path.getsize(box.workspace / "big") <= SPEC.max_file_mb << 20


def test_killing_the_parent_and_the_host_is_contained(box) -> None:
    me = os.getpid()
    result = box.exec(f"kill -9 {me}; kill -9 $PPID; kill -9 -1; kill -9 1; echo done", 10)
    assert os.getpid() == me  # still here
    assert box.exec("echo alive", timeout=10).stdout == "alive\n"
    assert result.exit_code != 0 or "done" in result.stdout


def test_no_process_is_left_behind(box) -> None:
    marker = f"{uuid.uuid4().int % 10**6}.25"
    box.exec(
        f"sleep {marker} & setsid sleep {marker} & nohup sleep {marker} >/dev/null 2>&1 & "
        f"(setsid bash -c 'sleep {marker}' &) ; disown -a; echo started",
        timeout=10,
    )
    time.sleep(0.2)
    assert processes_with(marker) == []
    assert "sleep" not in box.exec("ps -e 2>/dev/null || ls /proc", 10).stdout


def test_close_kills_a_running_command(store: Path) -> None:
    backend = LocalBackend(root=store.parent / "boxes")
    box = backend.create(store / "repo", SPEC)
    marker = f"{uuid.uuid4().int % 10**6}.5"
    results = []
    thread = threading.Thread(target=lambda: results.append(box.exec(f"sleep {marker}", 60)))
    thread.start()
    deadline = time.monotonic() + 10
    while not processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker)  # the matcher sees a live command (so the checks can fail)
    box.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and processes_with(marker) == []
    assert not box.home.exists()
    with pytest.raises(SandboxError, match="closed"):
        box.exec("true", 1)


def test_roll_environment_secrets_do_not_leak(box, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-SECRET_KEY")
    assert "SECRET_KEY" not in box.exec("env; cat /proc/*/environ", timeout=10).output()


def test_host_side_file_access_never_follows_links(box) -> None:
    box.exec("ln -s /etc/passwd passwd; ln -s / root; mkfifo pipe; echo x > ok.txt", 10)
    for path in ("passwd", "root/etc/passwd", "pipe", "../workspace/passwd", "/etc/passwd"):
        with pytest.raises(ValueError):
            box.read_file(path)
    with pytest.raises(ValueError):
        box.write_file("root/tmp/planted", "x")
    assert box.read_file("ok.txt") == "x\n"
    diff = box.diff()  # neither follows the links nor blocks on the FIFO
    assert "ok.txt" in diff and "passwd" not in diff


# the isolation attacks (the limits are the same rlimits whoever runs them)
UNPRIVILEGED = (
    "hidden or writes or network or way_out or another or killing or left_behind or secrets or "
    "unprivileged"
)


def _interpreter_for(uid: int) -> tuple[str, list[str]] | None:
    """An interpreter ``uid`` can run with this one's packages (a pyenv under /root is out
    of its reach: the system's python3 of the same version, on this one's site-packages)."""
    probe = "import sys; print(sys.version_info[:2])"
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            out = subprocess.run(
                [python, "-c", probe], user=uid, capture_output=True, text=True, timeout=30
            )
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == str(sys.version_info[:2]):
            return python, site.getsitepackages()
    return None


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="already running as an unprivileged user")
def test_the_attacks_as_an_unprivileged_user(tmp_path: Path) -> None:
    """This file again, as uid 65534 (no root anywhere: namespaces map nobody to 0)."""
    found = _interpreter_for(65534)
    if found is None:
        pytest.skip("no interpreter of this version that uid 65534 may run")
    python, packages = found
    tmp_path.chmod(0o777)
    root = Path(__file__).resolve().parents[2]
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.pathsep.join([str(root), *packages]),
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-x",
            "-k",
            UNPRIVILEGED,
        ],
        cwd=root,
        env=env,
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "1 skipped" in proc.stdout, tail  # this test skipped
