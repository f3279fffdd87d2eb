"""The demo's numbers cannot drift unnoticed (tools/demo_fingerprint.py says why and how).

On a CPU type with a record, the shortened demo SFT (200 steps through the real CLI) must give
exactly the recorded losses; a change on the demo's path fails here until someone re-runs
`nox -s demo` on that CPU, updates the README's table and records the new numbers. The README
must show, for every recorded CPU type, the demo numbers recorded with it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.conftest import ROLL

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    path = ROOT / "tools" / "demo_fingerprint.py"
    spec = importlib.util.spec_from_file_location("roll_tools_demo_fingerprint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fingerprint = _tool()


def _readme_rows() -> dict[str, tuple[str, str]]:
    """The README's demo table: CPU column -> (SFT, after RLVR) cells."""
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"\d+\.\d%", cells[2]):
            rows[cells[0]] = (cells[2], cells[3])
    return rows


def test_the_readme_shows_every_recorded_cpu_types_demo_numbers() -> None:
    record = fingerprint.load_record()
    assert record, "tests/assets/demo_fingerprint.json holds no CPU type"
    rows = _readme_rows()
    for key, entry in record.items():
        want = (f"{entry['demo_sft_exact_match']:.1f}%", f"{entry['demo_rlvr_exact_match']:.1f}%")
        assert want in rows.values(), (
            f"the README's demo table has no row with {want} (recorded for {key}); rows: {rows}"
        )


@pytest.mark.slow
def test_the_demo_sft_gives_the_recorded_numbers(cli_env: dict[str, str]) -> None:
    import torch

    from roll_core.runs.run import _cpu_name

    # the key a run records (meta.json), known before the 200 steps: skip at once without one
    here = f"{_cpu_name()}|{torch.backends.cpu.get_cpu_capability()}"
    if here not in fingerprint.load_record():
        pytest.skip(
            f"no demo fingerprint recorded for this CPU type ({here}); record one with "
            "`python tools/demo_fingerprint.py --record` after `nox -s demo`"
        )
    got = fingerprint.measure(ROLL, cli_env)
    key = str(got.pop("cpu"))
    assert key == here, f"the run recorded CPU type {key}, this process sees {here}"
    want = fingerprint.load_record()[key]
    numbers = ("train_loss", "eval_loss", "eval_exact_match")
    assert {k: got[k] for k in numbers} == {k: want[k] for k in numbers}, (
        "the demo's SFT numbers changed on this CPU type: something on its path changed. Re-run "
        "`nox -s demo` here, update the README's demo table, and record the new numbers with "
        "`python tools/demo_fingerprint.py --record --sft PCT --rlvr PCT`."
    )
