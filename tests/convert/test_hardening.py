"""`roll convert` under bad input, damaged files and signals: a clear error and an exit code,
the source never touched, no staging directory left behind (except after SIGKILL, which the
next run cleans), output readable as the umask says and every tensor in its own dtype."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roll_core.convert import hf_to_mcore, mcore_to_hf, open_checkpoint
from roll_core.convert.megatron import DistReader
from roll_core.convert.staging import checkpoint_errors
from roll_core.errors import CheckpointError, UsageError
from tests.conftest import ROLL
from tests.convert.conftest import COMMON, make_hf_model


@pytest.fixture(scope="module")
def dist_ckpt(hf_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist1") / "ckpt"
    hf_to_mcore(hf_models["qwen3"], out, fmt="torch_dist")
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def entries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def assert_clean_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
    text = " ".join(r.stderr.split())  # rich wraps long lines
    for needle in needles:
        assert needle in text, (needle, r.stderr)


def _storage(ckpt: Path, fqn: str) -> tuple[Path, int]:
    md = DistReader(ckpt / "release").metadata
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    return ckpt / "release" / info.relative_path, info.offset


# -- damaged torch_dist files ----------------------------------------------------------------


def test_damaged_torch_dist_files_are_clear_errors(roll, dist_ckpt: Path, tmp_path: Path) -> None:
    # torch.distributed.checkpoint raises CheckpointException (a BaseException) for these
    trunc = copy(dist_ckpt, tmp_path / "trunc")
    f, _ = _storage(trunc, "embedding.word_embeddings.weight")
    os.truncate(f, 1000)
    r = roll("convert", "mcore2hf", str(trunc), str(tmp_path / "out"))
    assert_clean_error(r, 1, "reading embedding.word_embeddings.weight", "__0_0.distcp",
                       "the file ends early (truncated)", "copy the checkpoint again")  # fmt: skip
    assert entries(tmp_path) == ["trunc"]  # no output, no staging directory

    corrupt = copy(dist_ckpt, tmp_path / "corrupt")
    f, offset = _storage(corrupt, "decoder.final_layernorm.weight")
    data = bytearray(f.read_bytes())
    data[offset : offset + 64] = b"\xff" * 64  # the tensor's serialised header
    f.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"final_layernorm.weight\) is damaged: its member .archive/data.pkl."
    ):
        mcore_to_hf(corrupt, tmp_path / "out")
    missing = copy(dist_ckpt, tmp_path / "missing")
    meta = missing / "release/.metadata"
    md = pickle.loads(meta.read_bytes())
    md.storage_data = {k: v for k, v in md.storage_data.items() if "final_layernorm" not in k.fqn}
    meta.write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"decoder\.final_layernorm\.weight .*no file"):
        mcore_to_hf(missing, tmp_path / "out")
    (missing / "release/metadata.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"holds a JSON list, not an object"):
        mcore_to_hf(missing, tmp_path / "out")
    (missing / "release/metadata.json").write_text('{"sharded_backend": ')
    with pytest.raises(CheckpointError, match=r"metadata\.json is not valid JSON"):
        mcore_to_hf(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _garbage_in_largest_member(archive: Path, offset: int = 0, length: int | None = None) -> str:
    """Overwrite 4 KiB inside the data of the largest member of the zip container (a
    torch.save) at ``offset`` of ``archive`` (``length`` bytes; None: to the end); return the
    member's name."""
    data = bytearray(archive.read_bytes())
    end = len(data) if length is None else offset + length
    with zipfile.ZipFile(io.BytesIO(bytes(data[offset:end]))) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)
    assert info.file_size >= 8192 and info.compress_type == zipfile.ZIP_STORED
    header = offset + info.header_offset
    name_len, extra_len = struct.unpack("<HH", data[header + 26 : header + 30])
    start = header + 30 + name_len + extra_len + 1024  # inside the tensor's bytes
    data[start : start + 4096] = bytes(range(256)) * 16
    archive.write_bytes(bytes(data))
    return info.filename


def test_garbage_in_legacy_tensor_data_is_a_clear_error(
    roll, hf_models: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = tmp_path / "legacy"
    hf_to_mcore(hf_models["qwen3"], ckpt, fmt="legacy")
    shard = ckpt / "release/mp_rank_00/model_optim_rng.pt"
    member = _garbage_in_largest_member(shard)
    r = roll("convert", "mcore2hf", str(ckpt), str(tmp_path / "out"))
    assert_clean_error(r, 1, f"{shard} is damaged", f"member '{member}'", "Bad CRC-32",
                       "copy the checkpoint again")  # fmt: skip
    assert entries(tmp_path) == ["legacy"]  # no output, no staging directory


def test_garbage_in_torch_dist_tensor_data_is_a_clear_error(
    dist_ckpt: Path, tmp_path: Path
) -> None:
    corrupt = copy(dist_ckpt, tmp_path / "corrupt")
    fqn = "embedding.word_embeddings.weight"
    md = DistReader(corrupt / "release").metadata
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    f, offset = corrupt / "release" / info.relative_path, info.offset
    member = _garbage_in_largest_member(f, offset, info.length)
    with pytest.raises(CheckpointError) as err:
        mcore_to_hf(corrupt, tmp_path / "out")
    text = str(err.value)
    assert f"{f} at byte {offset} (embedding.word_embeddings.weight) is damaged" in text
    assert f"member '{member}'" in text and "Bad CRC-32" in text
    assert entries(tmp_path) == ["corrupt"]


def test_checkpoint_exception_keeps_the_roll_error_inside(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    inner = UsageError("the real cause", hint="fix it")
    with pytest.raises(UsageError, match="the real cause"), checkpoint_errors("writing x"):
        raise CheckpointException("failed", {0: _wrap_exception(inner)})
    full = OSError(28, os.strerror(28), "f")
    with (
        pytest.raises(CheckpointError, match=r"writing x failed: No space left on device \(f\)"),
        checkpoint_errors("writing x"),
    ):
        raise CheckpointException("failed", {0: _wrap_exception(full)})


def test_hf_config_that_does_not_match_the_weights(
    roll, hf_models: dict[str, Path], tmp_path: Path
) -> None:
    src = copy(hf_models["qwen3"], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 192  # the weights have 96
    (src / "config.json").write_text(json.dumps(config))
    r = roll("convert", "hf2mcore", str(src), str(tmp_path / "out"))  # torch_dist writer
    assert_clean_error(r, 1, "make a tensor of shape (192, 64); config.json describes (384, 64)")
    assert entries(tmp_path) == ["src"]


# -- bad arguments and destinations ----------------------------------------------------------


def test_bad_vocab_size_and_destinations(
    roll, dist_ckpt: Path, hf_models: dict[str, Path], tmp_path: Path
) -> None:
    src = copy(dist_ckpt, tmp_path / "src")
    before = entries(src / "release")
    r = roll("convert", "mcore2hf", str(src), str(tmp_path / "o"), "--vocab-size", "-5")
    assert_clean_error(r, 2, "--vocab-size -5 is not a vocabulary size")
    r = roll("convert", "mcore2hf", str(src), str(src), "--overwrite")
    assert_clean_error(r, 2, "is SRC", "would overwrite its own input")
    assert entries(src / "release") == before and entries(tmp_path) == ["src"]  # nothing written

    with pytest.raises(UsageError, match=r"--vocab-size 0 is not a vocabulary size"):
        mcore_to_hf(src, tmp_path / "o", vocab_size=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match=r"(?s)file is a file.*whose parent is a directory"):
        mcore_to_hf(src, tmp_path / "file/out")
    with pytest.raises(UsageError, match=r"vocabulary size 300 does not fit .* 256 embedding"):
        mcore_to_hf(src, tmp_path / "o", vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": -5}))
    with pytest.raises(UsageError, match=r"vocabulary size -5 does not fit"):  # via --hf-config
        mcore_to_hf(src, tmp_path / "o", hf_config=tmp_path / "config.json")
    (tmp_path / "link").symlink_to(src)
    for dst in (tmp_path, src / "release/hf", tmp_path / "link", tmp_path / "link/x"):
        with pytest.raises(UsageError, match=r"would overwrite its own input|symbolic link"):
            mcore_to_hf(src, dst, overwrite=True)
    (tmp_path / "hf-link").symlink_to(hf_models["qwen3"])
    with pytest.raises(UsageError, match=r"is inside SRC"):
        hf_to_mcore(tmp_path / "hf-link", hf_models["qwen3"] / "mcore", overwrite=True)
    assert entries(src / "release") == before


# -- signals ---------------------------------------------------------------------------------


def test_stale_staging_is_removed_and_a_moved_aside_dst_restored(tmp_path: Path) -> None:
    from roll_core.convert.staging import clean_stale

    dead = 2**22 + 1  # above Linux's largest pid (pid_max <= 2**22): no such process
    (tmp_path / f".hf.tmp-{dead}-00ff").mkdir()  # a killed run's partial output
    (tmp_path / f".hf.old-{dead}-0a0b").mkdir()  # killed between moving DST aside and renaming
    (tmp_path / f".hf.old-{dead}-0a0b/config.json").write_text("old")
    (tmp_path / f".hf.tmp-{os.getpid()}-0c0d").mkdir()  # a running conversion: kept
    (tmp_path / f".other.tmp-{dead}-0e0f").mkdir()  # another DST's: kept
    clean_stale(tmp_path / "hf")
    assert entries(tmp_path) == [f".hf.tmp-{os.getpid()}-0c0d", f".other.tmp-{dead}-0e0f", "hf"]
    assert (tmp_path / "hf/config.json").read_text() == "old"


@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 48-layer torch_dist checkpoint: mcore2hf reads it layer by layer for a few seconds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("deep")
    kwargs = {**COMMON, "num_hidden_layers": 48}
    config = AutoConfig.for_model("qwen3", **kwargs, head_dim=16, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    hf_to_mcore(root / "hf", root / "mcore")
    return root / "mcore"


def _start(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [ROLL, *args], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_staging(parent: Path, name: str, proc: subprocess.Popen) -> Path:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = [p for p in parent.iterdir() if p.name.startswith(f".{name}.tmp-")]
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("no staging directory appeared")


@pytest.mark.slow
def test_sigterm_removes_staging_and_sigkill_leftovers_are_cleaned(
    cli_env: dict[str, str], deep_ckpt: Path, hf_models: dict[str, Path], tmp_path: Path
) -> None:
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "keep.txt").write_text("old model")
    args = ["convert", "mcore2hf", str(deep_ckpt), str(dst), "--overwrite"]
    proc = _start(args, cli_env, tmp_path)
    _wait_for_staging(tmp_path, "hf", proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr
    assert entries(tmp_path) == ["hf"] and entries(dst) == ["keep.txt"]  # DST as it was

    proc = _start(args, cli_env, tmp_path)
    staging = _wait_for_staging(tmp_path, "hf", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert staging.is_dir()  # nothing runs after SIGKILL
    r = subprocess.run([ROLL, "convert", "hf2mcore", str(hf_models["qwen3"]), str(dst),
                        "--overwrite"], env=cli_env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert entries(tmp_path) == ["hf"]  # the next run into the same DST removed the leftover
    assert (dst / "release/metadata.json").is_file()


# -- permissions and dtypes ------------------------------------------------------------------


def test_umask_permissions_and_auto_dtype_per_tensor(roll, tmp_path: Path) -> None:
    # a mixed-precision model: bf16 weights, fp32 norms (as a bf16 training run keeps them)
    src = make_hf_model("qwen3", tmp_path / "src", dtype=torch.bfloat16)
    tensors = load_file(src / "model.safetensors")
    tensors = {k: v.float() if "norm" in k else v for k, v in tensors.items()}
    from safetensors.torch import save_file

    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    old = os.umask(0o027)
    try:
        hf_to_mcore(src, tmp_path / "m", fmt="legacy")
        r = roll("convert", "mcore2hf", str(tmp_path / "m"), str(tmp_path / "hf"))
        assert r.returncode == 0, r.stderr
    finally:
        os.umask(old)
    assert "bfloat16 (also float32)" in " ".join(r.stdout.split())
    for path in (tmp_path / "m", tmp_path / "m/release", tmp_path / "hf"):
        assert path.stat().st_mode & 0o777 == 0o750, path  # 0o777 & ~0o027, not 0o700
    assert (tmp_path / "hf/model.safetensors").stat().st_mode & 0o777 == 0o640
    reader = open_checkpoint(tmp_path / "m")
    assert reader.read("decoder.final_layernorm.weight").dtype == torch.float32
    assert reader.read("self_attention.linear_qkv.weight", 0).dtype == torch.bfloat16
    back = load_file(tmp_path / "hf/model.safetensors")
    assert {k: v.dtype for k, v in back.items()} == {k: v.dtype for k, v in tensors.items()}
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"  # the embedding's
