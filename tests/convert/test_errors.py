"""Bad input to the converter: each case raises a RollError that says what was found."""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from roll_core.convert import hf_to_mcore, mcore_to_hf
from roll_core.convert.archs import dims_from_args
from roll_core.convert.safe_load import Opaque, load_pickle, load_torch_file
from roll_core.errors import CheckpointError, ModelError, UsageError


@pytest.fixture(scope="module")
def legacy_ckpt(hf_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("legacy") / "ckpt"
    hf_to_mcore(hf_models["qwen3"], out, tp=2, pp=2, fmt="legacy")
    return out


@pytest.fixture(scope="module")
def dist_ckpt(hf_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "ckpt"
    hf_to_mcore(hf_models["qwen3"], out, tp=2, pp=2, fmt="torch_dist")
    return out


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_src_that_is_neither_layout_says_what_it_found(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src/weights.bin").write_bytes(b"x")
    (tmp_path / "src/notes").mkdir()
    with pytest.raises(
        UsageError, match=r"neither a legacy.*nor a torch_dist.*notes/, weights\.bin"
    ):
        mcore_to_hf(tmp_path / "src", tmp_path / "out")


def test_missing_legacy_shard_is_listed(legacy_ckpt: Path, tmp_path: Path) -> None:
    ckpt = copy(legacy_ckpt, tmp_path)
    (ckpt / "release/mp_rank_01_001/model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"1 shard file\(s\) missing.*mp_rank_01_001"):
        mcore_to_hf(ckpt, tmp_path / "out")


def test_missing_distcp_file_is_listed(dist_ckpt: Path, tmp_path: Path) -> None:
    ckpt = copy(dist_ckpt, tmp_path)
    (ckpt / "release/__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"1 shard file\(s\) missing: .*__0_0\.distcp"):
        mcore_to_hf(ckpt, tmp_path / "out")


def test_shards_outside_the_parallel_sizes(legacy_ckpt: Path, tmp_path: Path) -> None:
    ckpt = copy(legacy_ckpt, tmp_path)
    shutil.copytree(ckpt / "release/mp_rank_01_000", ckpt / "release/mp_rank_02_000")
    with pytest.raises(
        CheckpointError, match=r"ranks \(tp, pp, ep\) \[\(2, 0, 0\)\], outside.*2x2x1"
    ):
        mcore_to_hf(ckpt, tmp_path / "out")


def test_shards_with_different_parallel_sizes(legacy_ckpt: Path, tmp_path: Path) -> None:
    ckpt = copy(legacy_ckpt, tmp_path)
    f = ckpt / "release/mp_rank_01_001/model_optim_rng.pt"
    sd = torch.load(f, weights_only=False)
    sd["args"].tensor_model_parallel_size = 4
    torch.save(sd, f)
    with pytest.raises(CheckpointError, match=r"mp_rank_01_001.*sizes \(4, 2, 1\).*\(2, 2, 1\)"):
        mcore_to_hf(ckpt, tmp_path / "out")


def test_unsupported_features_in_args_are_named() -> None:
    args = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "padded_vocab_size": 16}
    with pytest.raises(CheckpointError, match=r"normalization='LayerNorm'.*swiglu=False"):
        dims_from_args(args, vocab_size=None)
    moe = {
        **args,
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "add_bias_linear": False,
        "num_experts": 8,
    }
    dims = dims_from_args(moe, vocab_size=None)  # Qwen3-MoE routing with Megatron's defaults
    assert (dims.moe, dims.num_experts, dims.moe_topk, dims.moe_norm_topk) == (True, 8, 2, True)
    assert dims.moe_ffn_hidden_size == 32  # moe_ffn_hidden_size defaults to ffn_hidden_size
    # an ungated shared expert, DeepSeek's sigmoid routing, a dense first layer: named
    bad = {
        **moe,
        "moe_shared_expert_intermediate_size": 64,
        "moe_router_score_function": "sigmoid",
        "moe_layer_freq": [0, 1],
        "moe_router_load_balancing_type": "sinkhorn",
    }
    with pytest.raises(
        CheckpointError,
        match=r"moe_router_score_function='sigmoid' \(supported: 'softmax'\); "
        r"moe_layer_freq=\[0, 1\] \(supported: 1\); "
        r"moe_router_load_balancing_type='sinkhorn' \(supported: 'aux_loss', 'seq_aux_loss', "
        r".*moe_shared_expert_gate=False \(supported: True\)",
    ):
        dims_from_args(bad, vocab_size=None)
    assert dims_from_args({**moe, "moe_layer_freq": [1, 1]}, vocab_size=None).moe


def test_unsupported_hf_architecture_lists_supported(tmp_path: Path) -> None:
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2/config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "gpt2/model.safetensors").write_bytes(b"")
    with pytest.raises(
        UsageError, match=r"'gpt2' is not supported\. Supported: llama .*qwen2.*qwen3"
    ):
        hf_to_mcore(tmp_path / "gpt2", tmp_path / "out")


def test_wrong_arch_flag(legacy_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"a qwen2 model has qkv_bias=True.*qkv_bias=False"):
        mcore_to_hf(legacy_ckpt, tmp_path / "out", arch="qwen2")


def test_dst_not_empty_is_refused_unless_overwrite(legacy_ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="is not empty"):
        mcore_to_hf(legacy_ckpt, dst)
    assert (dst / "keep.txt").exists()
    mcore_to_hf(legacy_ckpt, dst, overwrite=True)
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left


def test_tp_that_does_not_divide_the_heads(hf_models: dict[str, Path], tmp_path: Path) -> None:
    # 2 key/value heads cannot be split over 4 ranks; 4 layers not over 3 stages
    with pytest.raises(UsageError, match=r"num_hidden_layers 4 is not divisible by --pp 3.*"
                       r"num_key_value_heads 2 is not divisible by --tp 4"):  # fmt: skip
        hf_to_mcore(hf_models["llama"], tmp_path / "out", tp=4, pp=3)
    assert not (tmp_path / "out").exists()


def test_hf_config_that_does_not_match(
    legacy_ckpt: Path, hf_models: dict[str, Path], tmp_path: Path
) -> None:
    config = json.loads((hf_models["qwen3"] / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"ffn_hidden_size: checkpoint 96 vs config 128"):
        mcore_to_hf(legacy_ckpt, tmp_path / "out", hf_config=tmp_path / "config.json")


def test_missing_hf_weights(tmp_path: Path, hf_models: dict[str, Path]) -> None:
    src = copy(hf_models["llama"], tmp_path)
    (src / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors weights"):
        hf_to_mcore(src, tmp_path / "out")


# -- the safe unpickler ----------------------------------------------------------------------


class _Evil:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, (f"touch {self.target}",))


class _TorchCall:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (torch.save, ({}, "/dev/null"))


def test_safe_loader_never_runs_code_from_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump(_Evil(marker), f)
    loaded = load_pickle(tmp_path / "evil.pkl")  # os.system is not imported, let alone called
    assert isinstance(loaded, Opaque) and not marker.exists()
    with open(tmp_path / "torch.pkl", "wb") as f:
        pickle.dump(_TorchCall(), f)
    with pytest.raises(CheckpointError, match="refusing to load global torch.serialization.save"):
        load_pickle(tmp_path / "torch.pkl")


def test_safe_loader_keeps_unknown_classes_as_records(tmp_path: Path) -> None:
    # a Megatron enum in args (Megatron is not installed): an inert record
    fake = types.ModuleType("fake_megatron_enums")

    class AttnBackend:
        def __init__(self, value: int) -> None:
            self.value = value

        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (AttnBackend, (self.value,))

    AttnBackend.__module__ = fake.__name__
    AttnBackend.__qualname__ = "AttnBackend"
    fake.AttnBackend = AttnBackend  # type: ignore[attr-defined]
    sys.modules[fake.__name__] = fake
    try:
        payload = {"args": argparse.Namespace(num_layers=2, backend=AttnBackend(5))}
        torch.save({**payload, "w": torch.ones(2)}, tmp_path / "ok.pt")
    finally:
        del sys.modules[fake.__name__]
    loaded = load_torch_file(tmp_path / "ok.pt")
    assert loaded["args"].num_layers == 2 and torch.equal(loaded["w"], torch.ones(2))
    assert isinstance(loaded["args"].backend, Opaque)
    assert loaded["args"].backend.args == (5,)
    assert repr(loaded["args"].backend) == "Opaque(fake_megatron_enums.AttnBackend, 5)"


# -- mixture of experts ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_legacy_ckpt(hf_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "ckpt"
    hf_to_mcore(hf_models["qwen3_moe"], out, tp=2, pp=1, ep=2, fmt="legacy")
    return out


def test_ep_for_a_dense_model_or_experts_that_do_not_split(
    hf_models: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(UsageError, match=r"--ep 2: expert parallelism needs a mixture-of-experts"):
        hf_to_mcore(hf_models["qwen3"], tmp_path / "out", ep=2)
    # 4 experts over 3 ranks; expert size 32 over tp 4 is fine but 2 kv heads are not
    with pytest.raises(UsageError, match=r"num_key_value_heads 2 is not divisible by --tp 4; "
                       r"num_experts 4 is not divisible by --ep 3"):  # fmt: skip
        hf_to_mcore(hf_models["qwen3_moe"], tmp_path / "out", tp=4, ep=3)
    assert not (tmp_path / "out").exists()


def test_missing_expert_shard_is_listed(moe_legacy_ckpt: Path, tmp_path: Path) -> None:
    ckpt = copy(moe_legacy_ckpt, tmp_path)
    shutil.rmtree(ckpt / "release/mp_rank_01_001")  # tp rank 1, ep rank 1 (pp=1: no stage)
    with pytest.raises(
        CheckpointError, match=r"1 shard file\(s\) missing for tp=2 pp=1 ep=2: .*mp_rank_01_001/"
    ):
        mcore_to_hf(ckpt, tmp_path / "out")


def test_rank_dirs_that_do_not_fit_the_expert_parallel_size(
    moe_legacy_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = copy(moe_legacy_ckpt, tmp_path)
    shutil.copytree(ckpt / "release/mp_rank_01_001", ckpt / "release/mp_rank_01_000_001")
    with pytest.raises(CheckpointError, match=r"mp_rank_01_000_001 does not fit .* 2x1x2 "
                       r"\(expected names like mp_rank_00_000\)"):  # fmt: skip
        mcore_to_hf(ckpt, tmp_path / "out")


def test_legacy_experts_split_differently_from_attention(
    moe_legacy_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = copy(moe_legacy_ckpt, tmp_path)
    for f in (ckpt / "release").glob("*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].expert_tensor_parallel_size = 1
        torch.save(sd, f)
    with pytest.raises(CheckpointError, match=r"expert-tensor-parallel size 1.*tensor-parallel "
                       r"size 2; the legacy layout of such a run is not supported"):  # fmt: skip
        mcore_to_hf(ckpt, tmp_path / "out")


def test_moe_checkpoint_with_fewer_experts_than_args_say(
    moe_legacy_ckpt: Path, tmp_path: Path
) -> None:
    ckpt = copy(moe_legacy_ckpt, tmp_path)
    for f in (ckpt / "release").glob("*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        sd["args"].num_experts = 6  # 3 per ep rank; each file holds 2
        torch.save(sd, f)
    with pytest.raises(CheckpointError, match=r"layer 0 mlp\.router\.weight has shape \(4, 64\); "
                       r"the checkpoint's args describe \(6, 64\)"):  # fmt: skip
        mcore_to_hf(ckpt, tmp_path / "out")


def test_hf_moe_with_dense_layers_is_refused(hf_models: dict[str, Path], tmp_path: Path) -> None:
    src = copy(hf_models["qwen3_moe"], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["mlp_only_layers"] = [0]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"mlp_only_layers=\[0\]; a qwen3_moe model the "
                       r"converter supports has mlp_only_layers=\[\]"):  # fmt: skip
        hf_to_mcore(src, tmp_path / "out")


def test_arch_flag_moe_vs_dense(moe_legacy_ckpt: Path, legacy_ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(
        UsageError, match=r"a qwen3 model has .*moe=False; this checkpoint has moe=True"
    ):
        mcore_to_hf(moe_legacy_ckpt, tmp_path / "a", arch="qwen3")
    with pytest.raises(
        UsageError,
        match=r"a qwen3_moe model has .*moe=True, shared_experts=False; this checkpoint has moe=False\.",
    ):
        mcore_to_hf(legacy_ckpt, tmp_path / "b", arch="qwen3_moe")


def test_top1_with_renormalised_weights_has_no_megatron_form(
    hf_models: dict[str, Path], tmp_path: Path
) -> None:
    src = copy(hf_models["qwen3_moe"], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["num_experts_per_tok"] = 1
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"top-1 routing with renormalised weights"):
        hf_to_mcore(src, tmp_path / "out")


# -- Megatron arguments that change the math -------------------------------------------------

RMS_ROPE = {
    "num_layers": 2,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "padded_vocab_size": 16,
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "add_bias_linear": False,
}


def test_megatron_args_that_change_the_math_are_mapped_or_named() -> None:
    dims = dims_from_args(
        {**RMS_ROPE, "rotary_interleaved": True, "rotary_seq_len_interpolation_factor": 8},
        vocab_size=None,
    )
    assert (dims.rotary_interleaved, dims.rope_scaling_factor) == (True, 8.0)
    assert (
        dims_from_args(  # factor 1 is no scaling
            {**RMS_ROPE, "rotary_seq_len_interpolation_factor": 1.0}, vocab_size=None
        ).rope_scaling_factor
        is None
    )
    bad = {
        **RMS_ROPE,
        "rotary_seq_len_interpolation_factor": -2,
        "apply_residual_connection_post_layernorm": True,
        "apply_layernorm_1p": True,
        "window_size": (128, 0),
        "multi_latent_attention": True,
        "apply_query_key_layer_scaling": True,  # the same function: accepted
    }
    with pytest.raises(CheckpointError) as e:
        dims_from_args(bad, vocab_size=None)
    text = str(e.value)
    for name in ("apply_residual_connection_post_layernorm=True", "apply_layernorm_1p=True",
                 "window_size=(128, 0)", "multi_latent_attention=True",
                 "rotary_seq_len_interpolation_factor=-2.0 (must be positive)"):  # fmt: skip
        assert name in text, name
    assert "apply_query_key_layer_scaling" not in text
    moe = {**RMS_ROPE, "num_experts": 4, "moe_expert_capacity_factor": 1.0}
    with pytest.raises(
        CheckpointError, match=r"moe_expert_capacity_factor=1\.0 \(supported: None\)"
    ):
        dims_from_args(moe, vocab_size=None)


def test_hf_rope_scaling_linear_is_read_others_refused(hf_models: dict[str, Path]) -> None:
    from roll_core.convert.archs import dims_from_hf_config, get_arch

    config = json.loads((hf_models["llama"] / "config.json").read_text())
    spec = get_arch("llama")
    linear = {
        **config,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    }
    assert dims_from_hf_config(spec, linear, 256).rope_scaling_factor == 2.0
    yarn = {**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UsageError, match=r"rope scaling .*yarn.*plain RoPE and linear scaling"):
        dims_from_hf_config(spec, yarn, 256)
