"""Build tiny Megatron-core GPT models on CPU, save them, run their forward pass.

Test-only helper for tests/convert (needs the `megatron-core` package from the `dev` extra).
It starts ``tp * pp * ep`` processes on the gloo backend (no GPU), and for every architecture
asked for:

* ``save``: builds a tiny ``GPTModel`` (local, non-Transformer-Engine layer spec) with
  megatron-core's own initialisation, gives every norm weight and bias random values (they
  start as ones and zeros, which would hide a mapping mistake) and every expert values of its
  own (each expert-parallel rank starts its local experts from the same seed), saves the model
  in the legacy layout (``iter_0000001/mp_rank_TT_PPP[_EEE]/model_optim_rng.pt``, as
  Megatron-LM writes it: one file per TP rank, stage and EP rank) and in
  the ``torch_dist`` layout (``megatron.core.dist_checkpointing.save``), and writes the logits
  of megatron-core's forward pass on a fixed input to ``logits.pt``;
* ``load``: builds the same model, loads a checkpoint (either layout) with megatron-core's own
  loaders, strictly, and writes the logits of its forward pass to ``logits.pt``.

``qwen3_moe`` is a mixture-of-experts GPTModel (``SequentialMLP`` experts, the ``allgather``
token dispatcher, no sequence parallelism: the local norms refuse it); run it with ``--ep 2``
(the data-parallel size then equals the expert-parallel size).

Megatron-core runs on CPU with six small patches, five in :func:`_patch_megatron_for_cpu`:
``torch.cuda.current_device`` returns ``"cpu"`` (rotary embeddings move their frequencies to
it), ``torch.cuda.synchronize`` does nothing (the checkpoint writer calls it), ``Tensor.cuda()``
leaves a tensor on the CPU (tied embeddings are all-reduced from "cuda"), the CUDA RNG
tracker's ``fork`` is a no-op (dropout is 0 and the models are in eval mode), the MoE router's
``te_general_gemm`` (undefined without Transformer Engine in megatron-core 0.16) is ``None`` so
it uses ``torch.mm``; and the attention mask is passed explicitly (the default causal mask is
built on ``cuda``).

Usage::

    python tests/convert/megatron_fixture.py save OUT --tp 2 --pp 2 --arch llama --arch qwen3
    python tests/convert/megatron_fixture.py load qwen2:CKPT_DIR:OUT_LOGITS ... --tp 2 --pp 2
    python tests/convert/megatron_fixture.py save OUT --tp 2 --pp 2 --ep 2 --arch qwen3_moe
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 64
HEADS = 4
GROUPS = 2
FFN = 96
LAYERS = 4
TRUE_VOCAB = 250  # padded to 256 in the checkpoint (divisible by 64 * tp)
SEQ = 12

# Per architecture: the TransformerConfig / GPTModel settings that make it that architecture,
# the way Megatron-LM's own argument set describes it.
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "tied": False,
        "kv_channels": 16,
        "rotary_base": 10000,
    },
    "qwen2": {
        "add_qkv_bias": True,
        "qk_layernorm": False,
        "tied": True,
        "kv_channels": 16,
        "rotary_base": 1000000,
    },
    "qwen3": {
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "tied": False,
        "kv_channels": 24,
        "rotary_base": 1000000,
    },
    # Qwen3-MoE: every layer's MLP is a mixture of EXPERTS experts (top-TOPK routing,
    # softmax over the top-k logits = HF's norm_topk_prob), each a SwiGLU MLP of size MOE_FFN.
    "qwen3_moe": {
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "tied": False,
        "kv_channels": 16,
        "rotary_base": 1000000,
        "num_experts": 4,
    },
    # Qwen2-MoE: q/k/v bias, tied, softmax over all experts before the top-k (no
    # renormalisation), and a shared expert of size 48 behind a sigmoid gate
    "qwen2_moe": {
        "add_qkv_bias": True,
        "qk_layernorm": False,
        "tied": True,
        "kv_channels": 16,
        "rotary_base": 1000000,
        "num_experts": 4,
        "pre_softmax": True,
        "shared_ffn": 48,
    },
    # RoPE variants HF has no direct flag for: Megatron's interleaved rotary pairs (mcore2hf
    # reorders the q/k rows) and linear position interpolation (HF rope_scaling "linear")
    "qwen3_rope": {
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "tied": False,
        "kv_channels": 24,
        "rotary_base": 10000,
        "rotary_interleaved": True,
        "interpolation": 4.0,
    },
    "qwen2_rope": {
        "add_qkv_bias": True,
        "qk_layernorm": False,
        "tied": True,
        "kv_channels": 16,
        "rotary_base": 10000,
        "rotary_interleaved": True,
    },
}
EXPERTS = 4
TOPK = 2
MOE_FFN = 32


def input_ids() -> torch.Tensor:
    """The fixed input every forward pass uses: [1, SEQ] token ids below TRUE_VOCAB."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, TRUE_VOCAB, (1, SEQ), generator=g)


def megatron_args(arch: str, tp: int, pp: int, ep: int = 1) -> argparse.Namespace:
    """The Megatron-LM training arguments stored in the checkpoint (``args``)."""
    a = ARCHS[arch]
    moe = {}
    if a.get("num_experts"):
        moe = dict(
            num_experts=a["num_experts"],
            moe_router_topk=TOPK,
            moe_ffn_hidden_size=MOE_FFN,
            moe_router_pre_softmax=a.get("pre_softmax", False),
            moe_router_score_function="softmax",
            moe_router_topk_scaling_factor=None,
            moe_router_enable_expert_bias=False,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.001,
            moe_shared_expert_intermediate_size=a.get("shared_ffn"),
            moe_shared_expert_gate=a.get("shared_ffn") is not None,
            moe_layer_freq=1,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            expert_tensor_parallel_size=tp,
        )
    base = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=GROUPS,
        kv_channels=a["kv_channels"],
        max_position_embeddings=128,
        seq_length=SEQ,
        position_embedding_type="rope",
        rotary_base=a["rotary_base"],
        rotary_percent=1.0,
        rotary_interleaved=a.get("rotary_interleaved", False),
        rotary_seq_len_interpolation_factor=a.get("interpolation"),
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=a["add_qkv_bias"],
        qk_layernorm=a["qk_layernorm"],
        untie_embeddings_and_output_weights=not a["tied"],
        padded_vocab_size=256,
        vocab_size=TRUE_VOCAB,
        make_vocab_size_divisible_by=64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        num_experts=None,
        transformer_impl="local",
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
    )
    return argparse.Namespace(**{**base, **moe})


def _patch_megatron_for_cpu() -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16 leaves this name undefined without Transformer Engine; the router's
    # gating linear tests it for None and then uses torch.mm
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    mrandom.CudaRNGStatesTracker.fork = (  # type: ignore[method-assign]
        lambda self, name=None: contextlib.nullcontext()
    )


def build_model(arch: str) -> Any:
    """This rank's stage of the tiny GPTModel, initialised by megatron-core (seeded)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    a = ARCHS[arch]
    moe: dict[str, Any] = {}
    if a.get("num_experts"):
        tp = ps.get_tensor_model_parallel_world_size()
        moe = dict(
            num_moe_experts=a["num_experts"],
            moe_router_topk=TOPK,
            moe_ffn_hidden_size=MOE_FFN,
            moe_router_pre_softmax=a.get("pre_softmax", False),
            moe_shared_expert_intermediate_size=a.get("shared_ffn"),
            moe_shared_expert_gate=a.get("shared_ffn") is not None,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.001,
            moe_token_dispatcher_type="allgather",
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=tp,
        )
    torch.manual_seed(0)  # use_cpu_initialization: every TP rank builds the same master weight
    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        kv_channels=a["kv_channels"],
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        use_cpu_initialization=True,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=a["add_qkv_bias"],
        qk_layernorm=a["qk_layernorm"],
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        init_method_std=0.05,
        rotary_interleaved=a.get("rotary_interleaved", False),
        **moe,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=a.get("num_experts"), qk_layernorm=a["qk_layernorm"], normalization="RMSNorm"
    )
    model = GPTModel(
        cfg,
        spec,
        vocab_size=256,
        max_sequence_length=128,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=a["tied"],
        position_embedding_type="rope",
        rotary_base=a["rotary_base"],
        seq_len_interpolation_factor=a.get("interpolation"),
        parallel_output=False,
    )
    model.eval()
    return model


def _perturb_norms_and_biases(model: Any) -> None:
    """Norm weights start at 1 and biases at 0: give them values a mapping mistake would show.

    Seeded by the global parameter name (global layer id), so replicated tensors stay equal on
    every tensor-parallel rank; sharded biases also mix in the TP rank.
    """
    from megatron.core import parallel_state as ps

    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.endswith("bias") or "norm" in name):
                continue
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            seed_text = ".".join(parts) + (f"#tp{tp_rank}" if name.endswith("bias") else "")
            g = torch.Generator().manual_seed(
                sum(ord(c) * (i + 1) for i, c in enumerate(seed_text))
            )
            p.add_(0.2 * torch.randn(p.shape, generator=g))


def _perturb_experts(model: Any) -> None:
    """Every EP rank initialises its local experts from the same seed, so expert 0 and expert
    ``num_local`` would be equal and an expert-numbering mistake would go unseen: add noise
    drawn for the *global* (layer, expert, tensor), of the global shape, and keep this TP rank's
    part of it (fc1: the rank's ``[gate_r; up_r]`` rows; fc2: its columns)."""
    from megatron.core import parallel_state as ps

    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
    tp, tp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            if "local_experts" not in parts:
                continue
            layer = int(parts[2]) + offset
            local = int(parts[parts.index("local_experts") + 1])
            n_local = len(model.decoder.layers[0].mlp.experts.local_experts)
            expert = ep_rank * n_local + local
            seed_text = f"{layer}.{expert}.{parts[-2]}"
            g = torch.Generator().manual_seed(
                sum(ord(c) * (i + 1) for i, c in enumerate(seed_text))
            )
            if parts[-2] == "linear_fc1":  # per rank [gate_r; up_r] of the global [gate; up]
                full = torch.randn(p.shape[0] * tp, p.shape[1], generator=g)
                gate, up = full.chunk(2)
                part = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
            else:  # linear_fc2: row parallel, columns split
                full = torch.randn(p.shape[0], p.shape[1] * tp, generator=g)
                part = full.chunk(tp, dim=1)[tp_rank]
            p.add_(0.05 * part)


def forward_logits(model: Any) -> torch.Tensor | None:
    """Logits [1, SEQ, vocab] on the last stage (None elsewhere); PP by explicit send/recv."""
    from megatron.core import parallel_state as ps

    ids = input_ids()
    pos = torch.arange(SEQ)[None]
    mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]
    # with sequence parallelism the stages pass this rank's part of the sequence
    seq = (
        SEQ // ps.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else SEQ
    )
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(seq, 1, HIDDEN)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, pos, attention_mask=mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        return out


def _rank_dir() -> str:
    """Megatron-LM's ``get_checkpoint_name``: ``mp_rank_TT[_PPP][_EEE]``."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return name


def _save(model: Any, arch: str, out: Path, tp: int, pp: int, ep: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    args = megatron_args(arch, tp, pp, ep)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 1}

    legacy = out / arch / "legacy"
    path = legacy / "iter_0000001" / _rank_dir() / "model_optim_rng.pt"
    if ps.get_expert_data_parallel_rank() == 0:  # as Megatron-LM: one copy per (TP, PP, EP)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({**common, "model": model.state_dict_for_save_checkpoint()}, path)
    if dist.get_rank() == 0:
        (legacy / "latest_checkpointed_iteration.txt").write_text("1")

    dist_dir = out / arch / "torch_dist" / "iter_0000001"
    dist_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({**common, "model": model.sharded_state_dict()}, str(dist_dir))
    if dist.get_rank() == 0:
        (out / arch / "torch_dist" / "latest_checkpointed_iteration.txt").write_text("1")


def _load(model: Any, ckpt: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    it = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    it_dir = ckpt / ("release" if it == "release" else f"iter_{int(it):07d}")
    if (it_dir / "metadata.json").exists():
        # RAISE_ALL: a tensor or object missing from the checkpoint, or one the model does not
        # have, is an error
        loaded = dist_checkpointing.load(
            {"model": model.sharded_state_dict()}, str(it_dir), strict=StrictHandling.RAISE_ALL
        )
        if isinstance(loaded, tuple):
            loaded = loaded[0]
        model.load_state_dict(loaded["model"], strict=True)
        return
    sd = torch.load(it_dir / _rank_dir() / "model_optim_rng.pt", weights_only=False)
    model.load_state_dict(sd["model"], strict=True)


def _worker(rank: int, world: int, port: int, opts: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    _patch_megatron_for_cpu()
    ps.initialize_model_parallel(opts.tp, opts.pp, expert_model_parallel_size=opts.ep)
    if opts.command == "save":
        jobs = [(arch, "", str(Path(opts.out) / arch / "logits.pt")) for arch in opts.arch]
    else:
        jobs = [tuple(job.split(":", 2)) for job in opts.jobs]
    try:
        for arch, ckpt, out in jobs:
            model = build_model(arch)
            if opts.command == "save":
                _perturb_norms_and_biases(model)
                _perturb_experts(model)
                _save(model, arch, Path(opts.out), opts.tp, opts.pp, opts.ep)
            else:
                _load(model, Path(ckpt))
            target = Path(out)
            logits = forward_logits(model)
            first_copy = ps.get_tensor_model_parallel_rank() == 0 == ps.get_data_parallel_rank()
            if logits is not None and first_copy:
                target.parent.mkdir(parents=True, exist_ok=True)
                torch.save(logits.detach().clone(), target)
            dist.barrier()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save")
    save.add_argument("out")
    save.add_argument("--arch", action="append", choices=sorted(ARCHS), required=True)
    load = sub.add_parser("load")
    load.add_argument("jobs", nargs="+", help="ARCH:CHECKPOINT_DIR:LOGITS_FILE")
    for p in (save, load):
        p.add_argument("--tp", type=int, default=2)
        p.add_argument("--pp", type=int, default=2)
        p.add_argument("--ep", type=int, default=1, help="expert parallel (data parallel) size")
    opts = parser.parse_args(argv)
    world = opts.tp * opts.pp * opts.ep
    warnings.filterwarnings("ignore")  # "Transformer Engine and Apex are not installed"
    # Import megatron-core once here; the forked workers share it (saves an import per rank).
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    mp.start_processes(_worker, args=(world, _free_port(), opts), nprocs=world, start_method="fork")
    if opts.command == "save":
        meta = {"input_ids": input_ids().tolist(), "true_vocab": TRUE_VOCAB}
        (Path(opts.out) / "fixture.json").write_text(json.dumps(meta))


if __name__ == "__main__":
    sys.exit(main())
