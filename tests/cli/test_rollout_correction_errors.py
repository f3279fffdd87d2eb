"""Bad `algorithm.rollout_correction` settings: recipe errors (exit 2, one paragraph, no
traceback) before a run directory exists."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny-arith-rlvr.yaml")
RC = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ([f"{RC}.is_level=tokn"], "is_level: unknown level 'tokn'; did you mean 'token'?"),
        (
            [f"{RC}.rs_level=token", f"{RC}.rs_low=3", f"{RC}.rs_high=2"],
            "the band rs_low 3.0 >= rs_high 2.0 rejects every token",
        ),
        (
            [f"{RC}.preset=token_tis", "algorithm.tis_cap=2"],
            "would weight every token by pi_old / pi_infer twice",
        ),
    ],
)
def test_bad_rollout_correction_is_a_recipe_error(roll, tmp_path: Path, overrides, needle) -> None:
    runs = tmp_path / "runs"
    res = roll("train", "rlvr", RECIPE, f"runs_dir={runs}", *overrides)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    assert f"{RC}" in res.stderr or "algorithm:" in res.stderr
    assert needle in res.stderr
    assert not runs.exists()
