"""Megatron RoPE variants HF has no flag for convert exactly: checkpoints megatron-core writes
with ``rotary_interleaved`` (Qwen3 with q/k norms, Qwen2 with q/k/v biases) and with
``rotary_seq_len_interpolation_factor`` (4) give, after ``roll convert mcore2hf``, the logits of
megatron-core's own forward pass.

Needs ``megatron-core`` (``dev`` extra); one gloo process (tp=1, pp=1) builds both models.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from roll_core.convert import hf_to_mcore, mcore_to_hf, open_checkpoint
from roll_core.errors import UsageError
from tests.convert.test_megatron import TRUE_VOCAB, hf_logits, run_fixture

pytest.importorskip("megatron.core", reason="megatron-core (dev extra) is not installed")
pytestmark = pytest.mark.slow

ARCHS = ("qwen3_rope", "qwen2_rope")


@pytest.fixture(scope="module")
def rope_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron-rope")
    run_fixture("save", str(out), "--tp", "1", "--pp", "1", *(f"--arch={a}" for a in ARCHS))
    return out


def test_interleaved_rotary_and_interpolation_match_megatron(
    roll, rope_ckpts: Path, tmp_path: Path
) -> None:
    # through the CLI: qwen3_rope, torch_dist (interleaved rotary + interpolation factor 4)
    dst = tmp_path / "qwen3-dist"
    r = roll("convert", "mcore2hf", str(rope_ckpts / "qwen3_rope/torch_dist"), str(dst))
    assert r.returncode == 0, r.stderr
    config = json.loads((dst / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "linear"
    assert config["rope_parameters"]["factor"] == 4.0
    assert config["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 4.0}
    dirs = {("qwen3_rope", "torch_dist"): dst}
    for arch in ARCHS:
        for layout in ("legacy", "torch_dist"):
            if (arch, layout) not in dirs:
                dirs[(arch, layout)] = mcore_to_hf(
                    rope_ckpts / arch / layout, tmp_path / f"{arch}-{layout}"
                ).dst
    for (arch, _), d in dirs.items():
        reference = torch.load(rope_ckpts / arch / "logits.pt")[..., :TRUE_VOCAB]
        assert (hf_logits(d) - reference).abs().max().item() < 1e-5, d

    # the check can fail: without the linear scaling the same weights give other logits
    plain = tmp_path / "plain"
    shutil.copytree(dst, plain)
    config.pop("rope_scaling")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(config))
    reference = torch.load(rope_ckpts / "qwen3_rope/logits.pt")[..., :TRUE_VOCAB]
    assert (hf_logits(plain) - reference).abs().max().item() > 1e-2
    # ... so a --hf-config without it is refused, not used as is
    with pytest.raises(UsageError, match=r"rope_scaling_factor: checkpoint 4\.0 vs config None"):
        mcore_to_hf(rope_ckpts / "qwen3_rope/legacy", tmp_path / "x", hf_config=plain)


def test_without_the_reordering_interleaved_logits_differ(
    rope_ckpts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the check above can fail: keeping Megatron's interleaved row order moves the logits
    import roll_core.convert.convert as convert

    monkeypatch.setattr(convert, "rotary_halves_from_interleaved", lambda t, head_dim: t)
    hf = mcore_to_hf(rope_ckpts / "qwen2_rope/legacy", tmp_path / "hf").dst
    reference = torch.load(rope_ckpts / "qwen2_rope/logits.pt")[..., :TRUE_VOCAB]
    assert (hf_logits(hf) - reference).abs().max().item() > 1e-2  # measured 0.06


def test_hf_linear_scaling_goes_back_as_the_interpolation_factor(
    rope_ckpts: Path, tmp_path: Path
) -> None:
    hf = mcore_to_hf(rope_ckpts / "qwen3_rope/legacy", tmp_path / "hf").dst
    hf_to_mcore(hf, tmp_path / "mcore", fmt="legacy")
    args = open_checkpoint(tmp_path / "mcore").args
    assert args["rotary_seq_len_interpolation_factor"] == 4.0
    assert args["rotary_interleaved"] is False  # the q/k rows are in HF's (halves) order now
