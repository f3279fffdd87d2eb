"""`roll convert mcore2hf` on roll's own megatron checkpoints (the per-rank files of the
`megatron` train backend), without megatron-core: a 2-rank tensor-parallel checkpoint is
written by hand from builtin tiny-qwen3's weights (each rank's shard under megatron-core's
local names, as the backend saves them) and must convert back to those weights bit for bit;
partial and mixed checkpoints are errors naming the file. The real backend's checkpoints are
converted in tests/backends/test_megatron.py (slow: they need a training launch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roll_core.convert import mcore_to_hf
from roll_core.convert.convert import _producer, _roll_dims, plan
from roll_core.convert.hf import HFReader
from roll_core.convert.roll_megatron import RANK_FILE, RankPlace, rank_files_dir
from roll_core.convert.tensors import split_tp
from roll_core.errors import CheckpointError, UsageError
from roll_core.models import resolve_model_path

TP = 2


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(resolve_model_path("builtin:tiny-qwen3"))


def write_checkpoint(directory: Path, model_dir: Path) -> None:
    """tiny-qwen3 split over TP=2 (1 stage, no data parallelism), one file per rank."""
    reader = HFReader(model_dir)
    dims = _roll_dims(reader.config, TP)
    steps = plan(dims)
    produce = _producer(reader, dims, {k.mcore: k for k, _, _ in steps})
    directory.mkdir(parents=True)
    layout = {"world_size": TP, "tp": TP, "pp": 1, "ep": 1, "vpp": None, "sp": False}
    for rank in range(TP):
        place = RankPlace(tp_rank=rank, etp_rank=rank, dp_rank=0, edp_rank=0, ep_rank=0,
                          layers={i: (0, i) for i in range(dims.num_layers)},
                          n_local_experts=0, tied_embeddings=dims.tied_embeddings)  # fmt: skip
        model = {}
        for key, layer, expert in steps:
            names = [{key.mcore}] if layer is None else [set()]
            ((_, name),) = place.locate(key, layer, expert, names)
            full = produce(key.mcore, layer, expert)
            model[name] = split_tp(full, key.tp, TP, name=key.mcore)[rank].clone()
        state = {"layout": layout, "place": place.to_dict(), "hf_config": reader.config,
                 "model": [model], "optimizer": [], "rng": {}}  # fmt: skip
        torch.save(state, directory / RANK_FILE.format(rank=rank))


@pytest.fixture
def ckpt(tmp_path: Path, model_dir: Path) -> Path:
    """A run's checkpoints directory: step-000002/actor_train/ and the `latest` pointer."""
    root = tmp_path / "run" / "checkpoints"
    write_checkpoint(root / "step-000002" / "actor_train", model_dir)
    (root / "latest").write_text("step-000002\n")
    return root / "step-000002" / "actor_train"


def test_a_tensor_parallel_checkpoint_converts_to_its_weights_bitwise(
    ckpt: Path, model_dir: Path, tmp_path: Path
) -> None:
    result = mcore_to_hf(ckpt, tmp_path / "out", tokenizer=model_dir)
    assert (result.layout, result.tp, result.pp, result.ep) == ("roll megatron", 2, 1, 1)
    want = load_file(str(model_dir / "model.safetensors"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == HFReader(model_dir).config  # the run's model config, as recorded
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert not result.notes


def test_the_run_and_step_directories_lead_to_the_rank_files(ckpt: Path) -> None:
    run = ckpt.parents[2]
    for src in (run, run / "checkpoints", ckpt.parent, ckpt):
        assert rank_files_dir(src) == ckpt, src
    assert rank_files_dir(run / "nowhere") is None


def test_no_tokenizer_is_a_note(ckpt: Path, tmp_path: Path) -> None:
    result = mcore_to_hf(ckpt.parents[2], tmp_path / "out")
    assert any("--tokenizer" in n for n in result.notes), result.notes


def test_a_missing_rank_file_is_named(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "megatron-rank00001.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing megatron-rank00001\.pt.*2 ranks") as e:
        mcore_to_hf(ckpt, tmp_path / "out")
    assert "partial" in e.value.hint
    assert not (tmp_path / "out").exists()
    (ckpt / "megatron-rank00000.pt").unlink()
    (ckpt / "megatron-rank00002.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"megatron-rank00000\.pt is missing"):
        mcore_to_hf(ckpt, tmp_path / "out")


def test_a_file_of_another_run_is_refused(ckpt: Path, tmp_path: Path) -> None:
    torch.save({}, ckpt / "megatron-rank00002.pt")
    with pytest.raises(CheckpointError, match=r"megatron-rank00002\.pt.*2 ranks"):
        mcore_to_hf(ckpt, tmp_path / "out")
    (ckpt / "megatron-rank00002.pt").unlink()
    state = torch.load(ckpt / "megatron-rank00001.pt", weights_only=False)
    state["layout"]["tp"] = 4
    torch.save(state, ckpt / "megatron-rank00001.pt")
    with pytest.raises(CheckpointError, match=r"megatron-rank00001\.pt was saved with layout"):
        mcore_to_hf(ckpt, tmp_path / "out")


def test_ranks_that_do_not_cover_the_tensor_parallel_shards(ckpt: Path, tmp_path: Path) -> None:
    state = torch.load(ckpt / "megatron-rank00001.pt", weights_only=False)
    state["place"]["tp_rank"] = 0  # both files claim shard 0
    torch.save(state, ckpt / "megatron-rank00001.pt")
    with pytest.raises(CheckpointError, match=r"shards \[0\] of .*, not 0\.\.1"):
        mcore_to_hf(ckpt, tmp_path / "out")


def test_a_checkpoint_without_places_says_what_to_do(ckpt: Path, tmp_path: Path) -> None:
    state = torch.load(ckpt / "megatron-rank00000.pt", weights_only=False)
    del state["place"]
    torch.save(state, ckpt / "megatron-rank00000.pt")
    with pytest.raises(CheckpointError, match="did not record each rank's place") as e:
        mcore_to_hf(ckpt, tmp_path / "out")
    assert "Resume the run" in e.value.hint


def test_arch_does_not_apply(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--arch qwen2 does not apply"):
        mcore_to_hf(ckpt, tmp_path / "out", arch="qwen2")


def test_a_damaged_rank_file_is_named(ckpt: Path, tmp_path: Path) -> None:
    """One byte changed inside a tensor's data: the zip container's CRC names the file."""
    import zipfile

    path = ckpt / "megatron-rank00001.pt"
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    head = info.header_offset  # the local header: name and extra lengths at bytes 26 and 28
    start = head + 30 + int.from_bytes(raw[head + 26 : head + 28], "little")
    start += int.from_bytes(raw[head + 28 : head + 30], "little")
    raw[start + info.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"megatron-rank00001\.pt is damaged"):
        mcore_to_hf(ckpt, tmp_path / "out")
