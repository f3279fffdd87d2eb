"""`roll convert` end to end: the real CLI in a subprocess."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from roll_core.models import materialize_builtin


def test_cli_roundtrip_of_the_builtin_model(roll, tmp_path: Path, cache_dir: Path) -> None:
    src = materialize_builtin("tiny-qwen3", cache_dir)
    mcore, hf = tmp_path / "mcore", tmp_path / "hf"
    r = roll("convert", "hf2mcore", "builtin:tiny-qwen3", str(mcore), "--tp", "2", "--pp", "2")
    assert r.returncode == 0, r.stderr
    assert "converted Hugging Face model to torch_dist (tp=2, pp=2): qwen3, 2 layers" in r.stdout
    assert (mcore / "release/metadata.json").is_file()
    r = roll("convert", "mcore2hf", str(mcore), str(hf), "--tokenizer", str(src))
    assert r.returncode == 0, r.stderr
    assert "converted torch_dist checkpoint (tp=2, pp=2) to Hugging Face: qwen3" in r.stdout
    a, b = load_file(src / "model.safetensors"), load_file(hf / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (hf / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # the special token ids come from the tokenizer, as in the original config
    import json

    want, got = (json.loads((d / "config.json").read_text()) for d in (src, hf))
    assert (got["eos_token_id"], got["pad_token_id"]) == (
        want["eos_token_id"],
        want["pad_token_id"],
    )


def test_cli_errors_are_one_paragraph_and_an_exit_code(roll, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src/readme.txt").write_text("not a checkpoint")
    r = roll("convert", "mcore2hf", str(tmp_path / "src"), str(tmp_path / "out"))
    assert r.returncode == 2
    assert r.stderr.startswith("error:") and "Traceback" not in r.stderr
    assert "neither a legacy Megatron checkpoint" in r.stderr and "readme.txt" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full/keep.txt").write_text("x")
    r = roll("convert", "mcore2hf", str(tmp_path / "src"), str(tmp_path / "full"))
    assert r.returncode == 2
    assert "is not empty" in r.stderr and "--overwrite" in r.stderr


def test_cli_moe_with_expert_parallelism(roll, hf_models: dict[str, Path], tmp_path: Path) -> None:
    from roll_core.convert import mcore_to_hf

    src, mcore, hf = hf_models["qwen3_moe"], tmp_path / "mcore", tmp_path / "hf"
    r = roll("convert", "hf2mcore", str(src), str(mcore), "--tp", "2", "--ep", "2",
             "--format", "legacy")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "to legacy (tp=2, pp=1, ep=2): qwen3_moe, 4 layers" in r.stdout
    assert (mcore / "release/mp_rank_01_001/model_optim_rng.pt").is_file()  # tp 1, ep 1
    assert mcore_to_hf(mcore, hf).ep == 2
    a, b = load_file(src / "model.safetensors"), load_file(hf / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
