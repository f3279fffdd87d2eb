"""Checkpoints written by megatron-core itself (tests/convert/megatron_fixture.py) convert to
Hugging Face models whose logits match megatron-core's forward pass, and megatron-core loads
what hf2mcore writes (both layouts, tp=2, pp=2; Qwen3-MoE and Qwen2-MoE also ep=2) and
computes the same logits.

Needs the test-only dependency ``megatron-core`` (``dev`` extra); runs it on CPU in 4 gloo
processes (8 for the MoE model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roll_core.convert import hf_to_mcore, mcore_to_hf

pytest.importorskip("megatron.core", reason="megatron-core (dev extra) is not installed")
pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).with_name("megatron_fixture.py")
ARCHS = ("llama", "qwen2", "qwen3")
LAYOUTS = ("legacy", "torch_dist")
TRUE_VOCAB = 250


def run_fixture(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(FIXTURE), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def megatron_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    run_fixture("save", str(out), "--tp", "2", "--pp", "2", *(f"--arch={a}" for a in ARCHS))
    return out


@pytest.fixture(scope="module")
def converted(megatron_ckpts: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """mcore2hf of every fixture: {(arch, layout): HF directory}."""
    root = tmp_path_factory.mktemp("converted")
    return {
        (a, lay): mcore_to_hf(megatron_ckpts / a / lay, root / f"{a}-{lay}").dst
        for a in ARCHS
        for lay in LAYOUTS
    }


def hf_logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from tests.convert.megatron_fixture import input_ids

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids()).logits


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_checkpoint_gives_the_same_logits_in_hf(
    megatron_ckpts: Path, converted: dict, arch: str, layout: str
) -> None:
    reference = torch.load(megatron_ckpts / arch / "logits.pt")  # [1, 12, 256 padded]
    logits = hf_logits(converted[(arch, layout)])
    assert logits.shape == (1, 12, TRUE_VOCAB)
    assert (logits - reference[..., :TRUE_VOCAB]).abs().max().item() < 1e-5


def test_megatron_loads_what_hf2mcore_writes(
    megatron_ckpts: Path, converted: dict, tmp_path: Path
) -> None:
    jobs = []
    for arch in ARCHS:
        for fmt in LAYOUTS:
            ckpt = tmp_path / f"{arch}-{fmt}"
            hf_to_mcore(
                converted[(arch, "legacy")], ckpt, tp=2, pp=2, fmt=fmt,
                transformer_impl="local", make_vocab_size_divisible_by=64,
            )  # fmt: skip
            jobs.append(f"{arch}:{ckpt}:{tmp_path / f'{arch}-{fmt}.pt'}")
    run_fixture("load", *jobs, "--tp", "2", "--pp", "2")  # strict loads, forward pass
    for arch in ARCHS:
        reference = torch.load(megatron_ckpts / arch / "logits.pt")
        for fmt in LAYOUTS:
            logits = torch.load(tmp_path / f"{arch}-{fmt}.pt")
            real = (logits - reference)[..., :TRUE_VOCAB]
            assert real.abs().max().item() < 1e-6, (arch, fmt)
            # hf2mcore pads the vocabulary with zero rows: their logits are 0
            assert torch.equal(logits[..., TRUE_VOCAB:], torch.zeros(1, 12, 6)), (arch, fmt)


# -- Qwen3-MoE and Qwen2-MoE: tp=2 x pp=2 x ep=2 (8 gloo processes) --------------------------

MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron-moe")
    run_fixture(
        "save", str(out), "--tp", "2", "--pp", "2", "--ep", "2", *(f"--arch={a}" for a in MOE_ARCHS)
    )
    return out


@pytest.fixture(scope="module")
def moe_converted(moe_ckpts: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("converted-moe")
    return {
        (a, lay): mcore_to_hf(moe_ckpts / a / lay, root / f"{a}-{lay}")
        for a in MOE_ARCHS
        for lay in LAYOUTS
    }


def test_megatron_moe_files_are_what_megatron_lm_writes(moe_ckpts: Path) -> None:
    legacy = moe_ckpts / "qwen3_moe/legacy/iter_0000001"
    assert sorted(p.name for p in legacy.iterdir()) == [
        f"mp_rank_0{t}_00{p}_00{e}" for t in (0, 1) for p in (0, 1) for e in (0, 1)
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_megatron_moe_checkpoint_gives_the_same_logits_in_hf(
    moe_ckpts: Path, moe_converted: dict, arch: str, layout: str
) -> None:
    from transformers import AutoModelForCausalLM

    from tests.convert.megatron_fixture import input_ids

    result = moe_converted[(arch, layout)]
    assert (result.arch, result.tp, result.pp, result.ep) == (arch, 2, 2, 2)
    reference = torch.load(moe_ckpts / arch / "logits.pt")[..., :TRUE_VOCAB]
    model = AutoModelForCausalLM.from_pretrained(result.dst, dtype=torch.float32)
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (4, 2)
    with torch.no_grad():
        logits = model(input_ids()).logits
        assert (logits - reference).abs().max().item() < 1e-5
        # the check can fail: the experts differ, so swapping two of them (one from each
        # expert-parallel rank) in one layer changes the logits
        experts = model.model.layers[1].mlp.experts
        for w in (experts.gate_up_proj, experts.down_proj):
            w[[0, 2]] = w[[2, 0]].clone()
        assert (model(input_ids()).logits - reference).abs().max().item() > 1e-2


def test_megatron_loads_the_moe_checkpoints_hf2mcore_writes(
    moe_ckpts: Path, moe_converted: dict, tmp_path: Path
) -> None:
    jobs = []
    for arch in MOE_ARCHS:
        for fmt in LAYOUTS:
            ckpt = tmp_path / f"{arch}-{fmt}"
            hf_to_mcore(
                moe_converted[(arch, "torch_dist")].dst, ckpt, tp=2, pp=2, ep=2, fmt=fmt,
                transformer_impl="local", make_vocab_size_divisible_by=64,
            )  # fmt: skip
            jobs.append(f"{arch}:{ckpt}:{tmp_path / f'{arch}-{fmt}.pt'}")
    run_fixture("load", *jobs, "--tp", "2", "--pp", "2", "--ep", "2")
    for arch in MOE_ARCHS:
        reference = torch.load(moe_ckpts / arch / "logits.pt")
        for fmt in LAYOUTS:
            logits = torch.load(tmp_path / f"{arch}-{fmt}.pt")
            assert (logits - reference)[..., :TRUE_VOCAB].abs().max().item() < 1e-6, (arch, fmt)
            assert torch.equal(logits[..., TRUE_VOCAB:], torch.zeros(1, 12, 6)), (arch, fmt)
