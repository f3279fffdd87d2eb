"""Write or check `lock-cpu.txt`: every package the test and demo installs resolve to.

    python tools/lock.py           # resolve and (re)write lock-cpu.txt (`nox -s lock` runs this)
    python tools/lock.py --check   # exit 1 if lock-cpu.txt is stale against pyproject.toml

How the lock is made: pip resolves the install that `nox -s tests` does
(``pip install -c constraints-cpu.txt torch==2.13.0 -e ".[dev,cpu]"``) without installing
anything (``--dry-run --ignore-installed --report``), and every package of that resolution
except roll itself is written as ``name==version``, sorted by name. The same index state gives
the same file byte for byte: nothing in it depends on the time, the machine's installed
packages or the order pip printed them in. The resolution is for the platform it runs on
(Linux x86_64, CPython 3.11: the CPU machines the demo and the tests target).

Staleness: the lock's header records a SHA-256 of the inputs of the resolution (the
``dependencies`` and ``optional-dependencies`` of pyproject.toml and the pins of
constraints-cpu.txt). ``--check`` recomputes it and also checks that every package pyproject
names for the locked extras is pinned. Adding a dependency without re-running
``nox -s lock`` fails ``tests/tools/test_lock.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = "lock-cpu.txt"
CONSTRAINTS = "constraints-cpu.txt"
EXTRAS = ("dev", "cpu")
"""The extras the lock resolves (what `nox -s tests` installs; `nox -s demo` uses a subset)."""
TORCH = "torch==2.13.0"
HASH_PREFIX = "# inputs-sha256: "


def normalize(name: str) -> str:
    """PEP 503 normalized project name (``PyYAML`` -> ``pyyaml``, ``a_b.c`` -> ``a-b-c``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """The project name of a requirement string (``torch>=2.4; ...`` -> ``torch``)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    if match is None:
        raise ValueError(f"cannot read a project name from requirement {spec!r}")
    return normalize(match.group(1))


def _constraint_lines(root: Path) -> list[str]:
    lines = (root / CONSTRAINTS).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def inputs_hash(root: Path = ROOT) -> str:
    """SHA-256 of what the resolution depends on: pyproject's dependency lists and the pins
    of constraints-cpu.txt (canonical JSON, so formatting and comments do not count)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    inputs = {
        "dependencies": sorted(project.get("dependencies", [])),
        "optional": {
            k: sorted(v) for k, v in sorted(project.get("optional-dependencies", {}).items())
        },
        "constraints": sorted(_constraint_lines(root)),
        "extras": list(EXTRAS),
        "torch": TORCH,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def required_names(root: Path = ROOT) -> set[str]:
    """Every project pyproject names for the locked install (base + the locked extras)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in EXTRAS:
        specs += project.get("optional-dependencies", {}).get(extra, [])
    return {requirement_name(s) for s in specs}


def read_lock(path: Path) -> tuple[str | None, dict[str, str]]:
    """(the recorded inputs hash, {normalized name: version}) of a lock file."""
    recorded, pins = None, {}
    for line in path.read_text().splitlines():
        if line.startswith(HASH_PREFIX):
            recorded = line[len(HASH_PREFIX) :].strip()
        elif line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[normalize(name)] = version.strip()
    return recorded, pins


def check(root: Path = ROOT) -> list[str]:
    """Problems that make the lock stale (empty: up to date)."""
    path = root / LOCK
    if not path.is_file():
        return [f"{LOCK} is missing: run `nox -s lock`."]
    recorded, pins = read_lock(path)
    problems = []
    if recorded != inputs_hash(root):
        problems.append(
            f"{LOCK} was made from other dependencies than pyproject.toml / {CONSTRAINTS} now "
            "list (its inputs-sha256 differs): run `nox -s lock` and commit the result."
        )
    missing = sorted(required_names(root) - set(pins) - {"roll"})
    if missing:
        problems.append(f"{LOCK} pins none of: {', '.join(missing)}: run `nox -s lock`.")
    return problems


def resolve(root: Path = ROOT, python: str = sys.executable) -> dict[str, str]:
    """{name: version} of every package the locked install resolves to (roll excluded)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--report", str(report), "-c", CONSTRAINTS, TORCH, "-e", f".[{','.join(EXTRAS)}]"]
        subprocess.run(cmd, cwd=root, check=True)
        items = json.loads(report.read_text())["install"]
    # A local version label (`2.13.0+cpu`, from a wheel on the PyTorch index) is dropped:
    # PyPI has no such file, and `==2.13.0` still matches the local build where it is found.
    pins = {i["metadata"]["name"]: i["metadata"]["version"].split("+")[0] for i in items}
    return {n: v for n, v in pins.items() if normalize(n) != "roll"}


def render(pins: dict[str, str], digest: str) -> str:
    """The lock file's text: a fixed header, then ``name==version`` sorted by normalized name."""
    header = [
        "# Generated by `nox -s lock` (tools/lock.py); do not edit by hand.",
        f'# Every package of `pip install -c {CONSTRAINTS} {TORCH} -e ".[{",".join(EXTRAS)}]"`,',
        "# resolved on Linux x86_64 / CPython 3.11. `nox -s tests` and `nox -s demo` install",
        "# with `-c lock-cpu.txt`; tests/tools/test_lock.py fails when it is stale.",
        f"{HASH_PREFIX}{digest}",
    ]
    body = [
        f"{normalize(n)}=={v}" for n, v in sorted(pins.items(), key=lambda kv: normalize(kv[0]))
    ]
    return "\n".join(header + body) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only check that the lock is fresh.")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(f"stale lock: {p}", file=sys.stderr)
        return 1 if problems else 0
    pins = resolve()
    (ROOT / LOCK).write_text(render(pins, inputs_hash()))
    print(f"wrote {LOCK}: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
