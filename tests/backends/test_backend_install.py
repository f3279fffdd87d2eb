"""A train backend whose package is not installed (megatron-core, deepspeed) is refused before
anything starts, by validation, a new run and a resume alike, with the extra of roll that
installs it (`pip install 'roll[megatron]'`). The missing package is simulated with
`sys.modules[name] = None`, which makes Python's import system report it as absent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from roll_cli.main import app
from roll_core.backends.train import check_backend_installed
from roll_core.config.loader import dump_config, load_recipe
from roll_core.errors import ConfigError
from roll_core.pipelines import resume
from roll_core.runs import Run

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-arith-sft.yaml"


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make `package` look absent, also where an earlier test of this process imported it
    (its submodules, e.g. megatron.core, are in sys.modules then and would still be found)."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.mark.parametrize(
    ("backend", "module", "project"),
    [("megatron", "megatron", "megatron-core"), ("deepspeed", "deepspeed", "deepspeed")],
)
def test_a_missing_backend_package_names_its_extra(
    backend: str, module: str, project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_backend_installed(backend)  # installed here (the dev extra)
    _hide(monkeypatch, module)
    with pytest.raises(ConfigError) as info:
        check_backend_installed(backend)
    assert f"actor_train.backend is {backend}, which needs {project}" in info.value.message
    assert f"pip install 'roll[{backend}]'" in str(info.value.hint)
    for other in ("torch", "fsdp2"):  # nothing beyond torch
        check_backend_installed(other)


def test_validate_and_sft_refuse_megatron_without_megatron_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    args = [str(RECIPE), "actor_train.backend=megatron", f"runs_dir={runs}"]
    _hide(monkeypatch, "megatron")
    for command in (["validate"], ["sft"], ["sft", "--dry-run"]):
        res = CliRunner().invoke(app, [*command, *args])
        assert res.exit_code == 2, (command, res.output)
        assert "needs megatron-core" in res.output and "roll[megatron]" in res.output, res.output
        assert "Traceback" not in res.output
    assert not runs.exists()  # refused before a run directory exists


def test_resume_refuses_megatron_without_megatron_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A megatron run resumed where megatron-core is missing: the same error, the run's
    directory as it was."""
    cfg = load_recipe(RECIPE, ["actor_train.backend=megatron"])
    run = Run.create(
        tmp_path, config_yaml=dump_config(cfg), name="m", pipeline="sft", command=[], recipe=None
    )
    before = {p.name: p.read_bytes() for p in run.dir.iterdir()}
    _hide(monkeypatch, "megatron")
    with pytest.raises(ConfigError, match=r"roll\[megatron\]"):
        resume(run.id, runs_dir=tmp_path)
    assert {p.name: p.read_bytes() for p in run.dir.iterdir()} == before
    assert json.loads((run.dir / "meta.json").read_text())["status"] == "running"
