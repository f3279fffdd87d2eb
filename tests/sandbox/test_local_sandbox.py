"""The local sandbox's behaviour: the weaker exec mode, required isolation, the slot bound."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from roll_core.errors import SandboxError
from roll_core.sandbox import LocalBackend, SandboxSpec
from roll_core.sandbox import local as local_module
from roll_core.sandbox.host import landlock_abi
from roll_core.sandbox.local import LocalSandbox, namespaces_work

NS_OK, NS_WHY = namespaces_work(sys.executable, True, 65534)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "a.py").write_text("x = 1\n")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "fix.patch").write_text("SECRET\n")
    return tmp_path / "repo"


@pytest.mark.skipif(landlock_abi() == 0, reason="the exec mode's file rules need Landlock")
def test_the_exec_mode_confines_files_and_sockets(repo: Path) -> None:
    backend = LocalBackend()  # the system's temporary directory: uid 65534 can enter it
    box = LocalSandbox(backend, repo, SandboxSpec(isolation="preferred"), "exec")
    try:
        assert box.exec("echo 2 > b.txt && cat a.py b.txt", 20).stdout == "x = 1\n2\n"
        # a store every uid may read (mode 755/644): only Landlock keeps the command out
        store = Path(tempfile.mkdtemp(prefix="roll-store-"))
        try:
            store.chmod(0o755)
            (store / "fix.patch").write_text("SECRET\n")
            (store / "fix.patch").chmod(0o644)
            assert "SECRET" not in box.exec(f"cat {store}/fix.patch", 20).output()
        finally:
            shutil.rmtree(store)
        name = f"/tmp/roll-exec-{uuid.uuid4().hex}"
        box.exec(f"echo x > {name}", 20)
        assert not Path(name).exists()
        sock = box.exec("python3 -c 'import socket; socket.socket()'", 20)
        assert sock.exit_code != 0 and "Permission denied" in sock.stderr
        assert "+2" in box.diff()
    finally:
        box.close()
    assert not box.home.exists()
    if os.geteuid() == 0:  # a root directory nobody may enter is refused with the reason
        with pytest.raises(SandboxError, match="cannot enter"):
            LocalSandbox(LocalBackend(root=repo.parent / "boxes"), repo, SandboxSpec(), "exec")


def test_required_isolation_fails_clearly_without_namespaces(repo: Path, monkeypatch) -> None:
    monkeypatch.setattr(local_module, "namespaces_work", lambda *a: (False, "unshare: EPERM"))
    backend = LocalBackend(root=repo.parent / "boxes")
    with pytest.raises(SandboxError, match="needs isolation.*unshare: EPERM") as err:
        backend.create(repo, SandboxSpec())
    assert "isolation to 'preferred'" in str(err.value)
    assert backend.check(SandboxSpec(isolation="preferred")) == "exec"


@pytest.mark.skipif(not NS_OK, reason=f"namespaces unavailable here: {NS_WHY}")
def test_stdin_head_and_tail_and_a_missing_source(repo: Path) -> None:
    backend = LocalBackend(root=repo.parent / "boxes")
    with backend.create(repo, SandboxSpec(max_output_bytes=100)) as box:
        assert box.workdir == "/workspace"
        assert box.exec("cat", 20, stdin="hello\n" * 3).stdout == "hello\n" * 3
        r = box.exec("seq 1 200; echo err >&2", 20)
        assert r.truncated and r.stdout.startswith("1\n2\n") and r.stdout.endswith("200\n")
        assert r.stderr == "err\n" and r.output().endswith("200\nerr\n")
    with pytest.raises(SandboxError, match="not a directory"):
        backend.create(repo / "missing", SandboxSpec())


@pytest.mark.skipif(not NS_OK, reason=f"namespaces unavailable here: {NS_WHY}")
def test_one_slot_runs_commands_one_at_a_time(repo: Path) -> None:
    backend = LocalBackend(max_concurrent=1, root=repo.parent / "boxes")
    boxes = [backend.create(repo, SandboxSpec()) for _ in range(2)]
    results = []
    start = time.monotonic()
    threads = [threading.Thread(target=lambda b=b: results.append(b.exec("sleep 0.6", 20)))
               for b in boxes]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start >= 1.2 and all(r.ok for r in results)
    for box in boxes:
        box.close()


def test_a_preferred_fallback_warns(repo: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(local_module, "namespaces_work", lambda *a: (False, "no userns"))
    local_module._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="roll_core.sandbox.local"):
        LocalBackend().check(SandboxSpec(isolation="preferred"))
    assert "weaker 'exec' mode" in caplog.text and "no userns" in caplog.text
