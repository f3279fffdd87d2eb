"""Shared fixtures: a session-wide model cache and helpers to run the real `roll` CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLL = str(Path(sys.executable).parent / "roll")


# ---- the default suite and the extended one ----------------------------------------------------
#: `@pytest.mark.extended`: a long end-to-end variant of what a default test already runs end to
#: end (another backend or parallelism of the same pipeline, a benchmark's table, a second
#: cluster shape). `nox -s tests` (the README's command, CI's) leaves them out so the default
#: suite stays well inside CI's time; `nox -s tests -- --extended` or `pytest --extended` runs them.
EXTENDED = "extended"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the tests marked `extended` (long end-to-end variants)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--extended"):
        return
    left_out = [item for item in items if item.get_closest_marker(EXTENDED)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker(EXTENDED)]


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--extended"):
        return "extended tests: included"
    return "extended tests: left out (run them with --extended, or nox -s tests -- --extended)"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One built-in-model cache for the whole session (materialised once)."""
    return tmp_path_factory.mktemp("roll-cache")


def make_cli_env(cache_dir: Path) -> dict[str, str]:
    """The environment every `roll` subprocess of the tests runs in."""
    env = dict(os.environ)
    env.update(
        ROLL_CACHE_DIR=str(cache_dir),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        COLUMNS="200",
        RAY_DEDUP_LOGS="0",
    )
    env.pop("ROLL_DEBUG", None)
    return env


def make_roll(cli_env: dict[str, str]):
    """`roll(*args)` runs the installed `roll` console script and captures its output."""

    def run(*args: str, cwd: Path = ROOT, timeout: float = 300, env: dict | None = None):
        return subprocess.run(
            [ROLL, *args],
            env={**cli_env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def cli_env(cache_dir: Path) -> dict[str, str]:
    return make_cli_env(cache_dir)


@pytest.fixture
def roll(cli_env: dict[str, str]):
    """`roll(*args)` runs the installed `roll` console script and captures its output."""
    return make_roll(cli_env)


def write_tiny_recipe(directory: Path, **sections: object) -> Path:
    """Write a small, fast SFT recipe (runs under directory/runs) into directory/recipe.yaml;
    keyword args replace top-level sections."""
    import yaml

    recipe = {
        "pipeline": "sft",
        "name": "tiny-test",
        "seed": 0,
        "runs_dir": str(directory / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 512},
            "eval": {"path": str(ROOT / "data/tiny-arith/test.jsonl"), "max_rows": 32},
            "max_length": 64,
        },
        "trainer": {"max_steps": 12, "micro_batch_size": 8, "grad_accum_steps": 2},
        "actor_train": {"num_threads": 1, "optim": {"lr": 3.0e-3, "warmup_steps": 2}},
        "eval": {"every_steps": 6, "exact_match": True, "batch_size": 16, "max_new_tokens": 4},
        "checkpoint": {"every_steps": 4, "keep_last": 3},
        "tracking": {"backends": ["console", "jsonl"]},
    }
    recipe.update(sections)
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture
def tiny_recipe(tmp_path: Path):
    """Write a small, fast SFT recipe into tmp_path; keyword args replace top-level sections."""

    def make(**sections: object) -> Path:
        return write_tiny_recipe(tmp_path, **sections)

    return make


@pytest.fixture(scope="session")
def qwen_real(tmp_path_factory: pytest.TempPathFactory):
    """`qwen_real(kind)` -> a cached directory built from the real Qwen vocabulary
    (tests/qwen_real.py): kind "tokenizer-qwen3" / "tokenizer-qwen2.5" (tokenizer only) or
    "qwen3" / "qwen3-moe" / "qwen3-tpl2.5" (a random-init tiny model with the Qwen3 template, or
    the Qwen2.5 template for "qwen3-tpl2.5")."""
    from tests.qwen_real import write_model, write_tokenizer

    root = tmp_path_factory.mktemp("qwen-real")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            out = root / kind
            if kind.startswith("tokenizer-"):
                built[kind] = write_tokenizer(out, kind.removeprefix("tokenizer-"))
            else:
                template = "qwen2.5" if kind == "qwen3-tpl2.5" else "qwen3"
                built[kind] = write_model(out, template=template, moe=kind == "qwen3-moe")
        return built[kind]

    return get


# ---- scheduling of the default run (`pytest -n 2 --dist loadfile`) ----------------------------
#: Files that share a session fixture too costly to build twice: each group runs as one unit on
#: one worker (tests/backends/conftest.py: one vLLM engine per serving mode for all four).
SHARED_UNITS: dict[str, str] = {
    f"tests/backends/{name}.py": "vllm-engines"
    for name in ("test_vllm", "test_vllm_engine", "test_vllm_engine_batch", "test_vllm_load")
}
DURATIONS = ROOT / "tests" / "durations.json"


@pytest.hookimpl(optionalhook=True)  # an xdist hook: no error without xdist (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadfile, with the longest files first and SHARED_UNITS kept together.

    xdist hands out whole files in collection order, sorted by test count, so files of one long
    end-to-end test came last and set the wall time. Here each unit goes out longest first
    (seconds from tests/durations.json, written by `python -m tests.durations` from a junit
    report; a file not in it counts 1 s a test), which bounds the finish by the longest unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    import json
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    known: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}

    class LongestFirst(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_UNITS.get(path, path)

        def _seconds(self, unit: dict[str, bool]) -> float:
            files = {nodeid.split("::", 1)[0] for nodeid in unit}
            unknown = sum(1 for nodeid in unit if nodeid.split("::", 1)[0] not in known)
            return sum(known.get(f, 0.0) for f in files) + unknown

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:
                self.ordered = True
                self.workqueue = OrderedDict(
                    sorted(self.workqueue.items(), key=lambda kv: -self._seconds(kv[1]))
                )
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
