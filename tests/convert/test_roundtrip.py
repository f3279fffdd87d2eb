"""hf -> mcore -> hf is bitwise identical, for every architecture, layout and TP/PP split."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roll_core.convert import hf_to_mcore, mcore_to_hf, open_checkpoint
from roll_core.convert.safe_load import load_torch_file
from tests.convert.conftest import make_hf_model


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_bitwise_equal(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_roundtrip_tp2_pp2_is_bitwise_identical(
    hf_models: dict[str, Path], tmp_path: Path, arch: str, fmt: str
) -> None:
    src = hf_models[arch]
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    r = hf_to_mcore(src, mcore, tp=2, pp=2, fmt=fmt, make_vocab_size_divisible_by=64)
    assert (r.arch, r.layout, r.tp, r.pp, r.num_layers) == (arch, fmt, 2, 2, 4)
    # 250 tokens pad to a multiple of 64 * tp 2 = 128 -> 256
    assert r.notes == [
        "vocabulary padded from 250 to 256 rows (zeros); mcore2hf removes the padding again."
    ]
    assert (mcore / "latest_checkpointed_iteration.txt").read_text() == "release"
    back_r = mcore_to_hf(mcore, back)
    assert (back_r.arch, back_r.layout, back_r.tp, back_r.pp) == (arch, fmt, 2, 2)
    assert_bitwise_equal(src, back)
    c_src = json.loads((src / "config.json").read_text())
    c_back = json.loads((back / "config.json").read_text())
    assert {k: c_back.get(k) for k in SHAPE_KEYS} == {k: c_src.get(k) for k in SHAPE_KEYS}
    theta = c_src["rope_parameters"]["rope_theta"]
    assert c_back["rope_parameters"]["rope_theta"] == theta == c_back["rope_theta"]


@pytest.mark.parametrize(
    ("tp", "pp", "fmt", "impl"),
    [
        (1, 1, "legacy", "transformer_engine"),
        (2, 1, "legacy", "transformer_engine"),
        (1, 4, "torch_dist", "local"),
        (2, 2, "legacy", "local"),
    ],
)
def test_roundtrip_other_splits(
    hf_models: dict[str, Path], tmp_path: Path, tp: int, pp: int, fmt: str, impl: str
) -> None:
    src = hf_models["qwen3"]
    hf_to_mcore(src, tmp_path / "m", tp=tp, pp=pp, fmt=fmt, transformer_impl=impl)
    mcore_to_hf(tmp_path / "m", tmp_path / "back")
    assert_bitwise_equal(src, tmp_path / "back")


def test_bfloat16_roundtrip_keeps_dtype(tmp_path: Path) -> None:
    src = make_hf_model("qwen2", tmp_path / "bf16", dtype=torch.bfloat16)
    r = hf_to_mcore(src, tmp_path / "m", tp=2, pp=2, fmt="torch_dist")
    assert r.dtype == "bfloat16"
    assert mcore_to_hf(tmp_path / "m", tmp_path / "back").dtype == "bfloat16"
    assert_bitwise_equal(src, tmp_path / "back")
    # --dtype converts on the way out
    mcore_to_hf(tmp_path / "m", tmp_path / "f32", dtype="float32")
    assert {t.dtype for t in tensors(tmp_path / "f32").values()} == {torch.float32}


def test_legacy_files_have_megatron_names_and_shards(
    hf_models: dict[str, Path], tmp_path: Path
) -> None:
    hf_to_mcore(
        hf_models["qwen2"], tmp_path / "m", tp=2, pp=2, fmt="legacy", transformer_impl="local"
    )
    first = load_torch_file(tmp_path / "m/release/mp_rank_01_000/model_optim_rng.pt")
    last = load_torch_file(tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt")
    assert first["args"].tensor_model_parallel_size == 2
    assert first["checkpoint_version"] == 3.0
    sd, sd_last = first["model"], last["model"]
    # stage 0 holds layers 0, 1 (local ids 0, 1); stage 1 holds layers 2, 3 as local 0, 1
    assert "embedding.word_embeddings.weight" in sd and "decoder.final_layernorm.weight" not in sd
    assert sd["embedding.word_embeddings.weight"].shape == (128, 64)  # 256 padded rows / tp 2
    assert "decoder.layers.1.input_layernorm.weight" in sd  # local (non-TE) norm name
    assert "decoder.layers.2.input_layernorm.weight" not in sd
    # qkv rows: (4 heads + 2 * 2 groups) * 16 = 128, split by tp 2 -> 64; qwen2 has its bias
    assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, 64)
    assert sd["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (64,)
    assert sd["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 32)  # row
    assert sd["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96, 64)  # 2 * 96 / 2
    assert sd["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 48)
    assert sd["decoder.layers.0.mlp.linear_fc1._extra_state"] is None
    # qwen2 ties embeddings: the last stage keeps Megatron's copy as output_layer.weight
    assert torch.equal(sd_last["output_layer.weight"], sd["embedding.word_embeddings.weight"])


def test_both_layouts_read_the_same_global_tensors(
    hf_models: dict[str, Path], tmp_path: Path
) -> None:
    hf_to_mcore(hf_models["llama"], tmp_path / "a", tp=2, pp=2, fmt="legacy")
    hf_to_mcore(
        hf_models["llama"], tmp_path / "b", fmt="torch_dist", make_vocab_size_divisible_by=10
    )
    a, b = open_checkpoint(tmp_path / "a"), open_checkpoint(tmp_path / "b")
    assert (a.layout, a.tp, a.pp, a.num_layers) == ("legacy", 2, 2, 4)
    assert (b.layout, b.tp, b.pp, b.num_layers) == ("torch_dist", 1, 1, 4)
    for name in ("mlp.linear_fc1.weight", "self_attention.linear_qkv.weight"):
        for layer in range(4):
            assert torch.equal(a.read(name, layer), b.read(name, layer)), (name, layer)
    # tp=2 pads 250 rows to a multiple of 128 * 2 (256); a multiple of 10 needs no padding
    emb_a = a.read("embedding.word_embeddings.weight")
    emb_b = b.read("embedding.word_embeddings.weight")
    assert (emb_a.shape[0], emb_b.shape[0]) == (256, 250)
    assert torch.equal(emb_a[:250], emb_b[:250])


def test_shards_and_index(hf_models: dict[str, Path], tmp_path: Path) -> None:
    hf_to_mcore(hf_models["qwen3"], tmp_path / "m", fmt="torch_dist")
    mcore_to_hf(tmp_path / "m", tmp_path / "back", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "back/model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    assert sorted(p.name for p in (tmp_path / "back").glob("*.safetensors")) == files
    assert_bitwise_equal(hf_models["qwen3"], tmp_path / "back")


# -- mixture of experts: Qwen3-MoE, Qwen2-MoE ------------------------------------------------

#: (Megatron, HF) tensors per layer and outside the layers. Qwen3-MoE per layer: input norm,
#: qkv, q/k norms, proj, pre-MLP norm, router, 4 experts x (fc1, fc2) = 15 (HF: 2 norms, q k v
#: o, q/k norms, router, 4 x (gate, up, down) = 21); untied: embedding, final norm, output.
#: Qwen2-MoE: no q/k norms, q/k/v bias (1 fused, 3 in HF), shared expert fc1, fc2 and gate
#: (HF gate, up, down, gate) = 17 (HF 26); tied: no output layer.
MOE_COUNTS = {"qwen3_moe": ((15, 3), (21, 3)), "qwen2_moe": ((17, 2), (26, 2))}


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_roundtrip_tp2_pp2_ep2_is_bitwise_identical(
    hf_models: dict[str, Path], tmp_path: Path, arch: str, fmt: str, impl: str
) -> None:
    src = hf_models[arch]
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    r = hf_to_mcore(src, mcore, tp=2, pp=2, ep=2, fmt=fmt, transformer_impl=impl)
    assert (r.arch, r.layout, r.tp, r.pp, r.ep, r.num_layers) == (arch, fmt, 2, 2, 2, 4)
    (m_layer, m_global), (h_layer, h_global) = MOE_COUNTS[arch]
    assert r.num_tensors == 4 * m_layer + m_global
    back_r = mcore_to_hf(mcore, back)
    assert (back_r.arch, back_r.layout, back_r.tp, back_r.pp, back_r.ep) == (arch, fmt, 2, 2, 2)
    assert back_r.num_tensors == 4 * h_layer + h_global
    assert_bitwise_equal(src, back)
    c_src = json.loads((src / "config.json").read_text())
    c_back = json.loads((back / "config.json").read_text())
    moe_keys = ("moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob",
                "shared_expert_intermediate_size", "head_dim", "qkv_bias")  # fmt: skip
    assert {k: c_back.get(k) for k in SHAPE_KEYS + moe_keys} == {
        k: c_src.get(k) for k in SHAPE_KEYS + moe_keys
    }
    # transformers 5 writes num_local_experts for Qwen3-MoE; transformers 4 and vLLM read
    # num_experts
    assert c_back["num_experts"] == 4
    assert c_back.get("num_local_experts") == c_src.get("num_local_experts")


def test_moe_legacy_files_split_experts_over_ep_ranks(
    hf_models: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors import safe_open

    hf_to_mcore(hf_models["qwen3_moe"], tmp_path / "m", tp=2, pp=2, ep=2, fmt="legacy",
                transformer_impl="local")  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "m/release").iterdir())
    assert names == [f"mp_rank_0{t}_00{p}_00{e}" for t in (0, 1) for p in (0, 1) for e in (0, 1)]
    f = load_torch_file(tmp_path / "m/release/mp_rank_01_001_001/model_optim_rng.pt")
    sd = f["model"]
    assert f["args"].expert_model_parallel_size == 2 and f["args"].num_experts == 4
    assert f["args"].moe_ffn_hidden_size == 32 and f["args"].moe_router_topk == 2
    assert f["args"].moe_router_pre_softmax is False  # norm_topk_prob=True
    # stage 1 holds layers 2, 3 as local 0, 1; ep rank 1 holds experts 2, 3 as local 0, 1
    fc1 = sd["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    fc2 = sd["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in sd
    assert fc1.shape == (32, 64) and fc2.shape == (64, 16)  # (2 * 32 / tp 2, h), (h, 32 / 2)
    with safe_open(hf_models["qwen3_moe"] / "model.safetensors", "pt") as hf:
        gate = hf.get_tensor("model.layers.3.mlp.experts.2.gate_proj.weight")
        up = hf.get_tensor("model.layers.3.mlp.experts.2.up_proj.weight")
        down = hf.get_tensor("model.layers.3.mlp.experts.3.down_proj.weight")
        router = hf.get_tensor("model.layers.3.mlp.gate.weight")
    # tp rank 1 holds the second half of gate rows, then the second half of up rows
    assert torch.equal(fc1, torch.cat([gate[16:], up[16:]]))
    assert torch.equal(fc2, down[:, 16:])
    # router and norms are replicated over TP and EP ranks; the norm keeps its local name
    assert torch.equal(sd["decoder.layers.1.mlp.router.weight"], router)
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in sd
    assert sd["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2._extra_state"] is None
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in sd


def test_moe_ep_without_pp_and_grouped_gemm_names(
    hf_models: dict[str, Path], tmp_path: Path
) -> None:
    """pp=1, ep=2 names files mp_rank_TT_EEE (read by the args, not the name); Transformer
    Engine's grouped-GEMM experts (linear_fc1.weight<local id>) read like SequentialMLP's."""
    src = hf_models["qwen3_moe"]
    hf_to_mcore(src, tmp_path / "m", tp=2, pp=1, ep=2, fmt="legacy")
    names = sorted(p.name for p in (tmp_path / "m/release").iterdir())
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    for f in (tmp_path / "m/release").glob("*/model_optim_rng.pt"):
        sd = torch.load(f, weights_only=False)
        pat = re.compile(
            r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(\w+)\.weight$"
        )
        sd["model"] = {
            (pat.sub(r"\1\3.weight\2", k) if pat.match(k) else k): v for k, v in sd["model"].items()
        }
        assert "decoder.layers.3.mlp.experts.linear_fc2.weight1" in sd["model"]
        torch.save(sd, f)
    r = mcore_to_hf(tmp_path / "m", tmp_path / "back")
    assert (r.tp, r.pp, r.ep) == (2, 1, 2)
    assert_bitwise_equal(src, tmp_path / "back")


def test_moe_torch_dist_stacks_layers_and_experts(
    hf_models: dict[str, Path], tmp_path: Path
) -> None:
    hf_to_mcore(hf_models["qwen3_moe"], tmp_path / "te", fmt="torch_dist")
    hf_to_mcore(hf_models["qwen3_moe"], tmp_path / "local", fmt="torch_dist",
                transformer_impl="local")  # fmt: skip
    te, local = open_checkpoint(tmp_path / "te"), open_checkpoint(tmp_path / "local")
    fc1 = te.tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (4, 4, 64, 64)  # [layer, expert, 2 * 32, hidden]
    assert tuple(te.tensors["decoder.layers.mlp.router.weight"].size) == (4, 4, 64)
    # megatron-core's names of the pre-MLP norm: its own module with TE layers; the dense
    # MLP's fused-norm name with local layers
    assert "decoder.layers.pre_mlp_layernorm.weight" in te.tensors
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in local.tensors
    for reader in (te, local):
        assert torch.equal(
            reader.read("pre_mlp_layernorm.weight", 2), te.read("pre_mlp_layernorm.weight", 2)
        )
    objects = set(te.metadata.state_dict_metadata) - set(te.tensors)
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_3.1_4.4" in objects


def test_moe_hub_style_config(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """A Hub config.json (transformers 4 names: num_experts; optional keys left out) reads the
    same; norm_topk_prob false becomes Megatron's --moe-router-pre-softmax."""
    import shutil

    src = tmp_path / "hub"
    shutil.copytree(hf_models["qwen3_moe"], src)
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    del config["router_aux_loss_coef"]  # transformers' default: 0.001
    config["norm_topk_prob"] = False
    (src / "config.json").write_text(json.dumps(config))
    hf_to_mcore(src, tmp_path / "m", fmt="legacy")
    args = load_torch_file(tmp_path / "m/release/mp_rank_00/model_optim_rng.pt")["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)
    assert (args.moe_router_pre_softmax, args.moe_aux_loss_coeff) == (True, 0.001)
    mcore_to_hf(tmp_path / "m", tmp_path / "back")
    back = json.loads((tmp_path / "back/config.json").read_text())
    assert (back["num_experts"], back["norm_topk_prob"], back["router_aux_loss_coef"]) == (
        4, False, 0.001,
    )  # fmt: skip
    assert_bitwise_equal(src, tmp_path / "back")


def test_qwen2_moe_shared_expert_files(hf_models: dict[str, Path], tmp_path: Path) -> None:
    from safetensors import safe_open

    hf_to_mcore(hf_models["qwen2_moe"], tmp_path / "m", tp=2, ep=2, fmt="legacy")
    f = load_torch_file(tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt")
    sd, args = f["model"], f["args"]
    assert (args.moe_shared_expert_intermediate_size, args.moe_shared_expert_gate) == (48, True)
    assert args.moe_router_pre_softmax is True  # norm_topk_prob=False
    with safe_open(hf_models["qwen2_moe"] / "model.safetensors", "pt") as hf:
        gate = hf.get_tensor("model.layers.2.mlp.shared_expert.gate_proj.weight")
        up = hf.get_tensor("model.layers.2.mlp.shared_expert.up_proj.weight")
        down = hf.get_tensor("model.layers.2.mlp.shared_expert.down_proj.weight")
        score = hf.get_tensor("model.layers.2.mlp.shared_expert_gate.weight")
    # the shared expert is split over TP like a dense MLP (and held by every EP rank)
    fc1 = sd["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[24:], up[24:]]))
    assert torch.equal(sd["decoder.layers.2.mlp.shared_experts.linear_fc2.weight"], down[:, 24:])
    assert torch.equal(sd["decoder.layers.2.mlp.shared_experts.gate_weight"], score)  # [1, h]
    assert sd["decoder.layers.2.mlp.shared_experts.linear_fc1._extra_state"] is None
