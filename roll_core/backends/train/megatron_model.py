"""The Megatron-core side of the `megatron` train backend: the parallel layout, the GPTModel
built from a Hugging Face config, and HF weights in and out of its shards.

Every name and tensor rule comes from roll_core/convert (the `roll convert` mapping): the
model is built with megatron-core's local (non-Transformer-Engine) layer spec, so its
parameters carry the legacy local names (`LOCAL_NAMES`, `LEGACY_EXPERT_NAMES`); a global
Megatron tensor is made of its HF tensors by `to_mcore` and split over tensor-parallel ranks
by `split_tp`, and back by `merge_tp` + `to_hf`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roll_core.convert.archs import (
    KeyMap,
    ModelDims,
    check_dims,
    dims_from_hf_config,
    get_arch,
)
from roll_core.convert.convert import _producer, hf_names, plan, to_hf
from roll_core.convert.hf import HFReader
from roll_core.convert.roll_megatron import VOCAB_DIVISIBLE_BY, RankPlace
from roll_core.convert.tensors import merge_tp, padded_vocab_size, split_tp
from roll_core.errors import ConfigError, UsageError


@dataclass(frozen=True)
class Layout:
    """The parallel layout of one run: sizes and this rank's coordinates."""

    tp: int
    pp: int
    ep: int
    vpp: int | None
    sp: bool
    dp: int


def read_dims(model_path: str, tp: int) -> tuple[ModelDims, dict[str, Any]]:
    """The model's shape (roll_core/convert's ModelDims) from its config.json, and the config."""
    reader = HFReader(Path(model_path))
    config = reader.config
    spec = get_arch(str(config.get("model_type", "<missing model_type>")))
    vocab = int(config.get("vocab_size") or 0)
    dims = dims_from_hf_config(spec, config, padded_vocab_size(vocab, VOCAB_DIVISIBLE_BY, tp))
    check_dims(spec, dims)
    if dims.moe and config.get("output_router_logits"):
        raise ConfigError(
            f"{model_path} sets output_router_logits (train with the router's load-balancing "
            "loss); the megatron backend does not add that loss yet (megatron-core's per-layer "
            "form differs from transformers').",
            hint="Set output_router_logits: false in the model's config.json, or use "
            "actor_train.backend=torch / fsdp2 for this model.",
        )
    return dims, config


def check_layout(dims: ModelDims, layout: Layout) -> None:
    """Refuse a layout the model cannot be split into (a recipe error: names the sizes)."""
    stages = layout.pp * (layout.vpp or 1)
    problems = []
    if stages > dims.num_layers or dims.num_layers % stages:
        problems.append(
            f"{dims.num_layers} layers do not split into pp x vpp = {stages} pipeline stages"
        )
    if layout.ep > 1 and not dims.moe:
        problems.append(f"ep={layout.ep} needs a mixture-of-experts model; this one is dense")
    if dims.moe and (layout.ep > dims.num_experts or dims.num_experts % layout.ep):
        problems.append(f"{dims.num_experts} experts do not split over ep={layout.ep}")
    if dims.moe and layout.tp > 1 and not layout.sp:
        problems.append("a mixture-of-experts model with tp > 1 needs sp: true (megatron-core)")
    sizes = [("attention heads", dims.num_heads), ("key/value heads", dims.num_kv_heads),
             ("MLP size", dims.moe_ffn_hidden_size if dims.moe else dims.ffn_hidden_size)]  # fmt: skip
    problems += [
        f"{n} {what} do not split over tp={layout.tp}" for what, n in sizes if n % layout.tp
    ]
    if problems:
        raise ConfigError(
            "actor_train.megatron does not fit the model: " + "; ".join(problems) + ".",
            hint="Choose tp / pp / vpp / ep that divide the model's heads, MLP size, layers and "
            "experts (the recipe's fault, not the model's).",
        )


def check_recipe_layout(config: dict[str, Any], megatron: Any, world_size: int) -> None:
    """The validate-time check of an `actor_train.megatron` section against the model's
    config.json as a dict (ep > experts, pp > layers, sizes tp does not divide)."""
    try:
        spec = get_arch(str(config.get("model_type", "<missing model_type>")))
    except UsageError as err:
        raise ConfigError(
            f"actor_train.backend megatron cannot build this model: {err.message}",
            hint="Use actor_train.backend fsdp2 or deepspeed for other architectures.",
        ) from None
    vocab = int(config.get("vocab_size") or 0)
    padded = padded_vocab_size(vocab, VOCAB_DIVISIBLE_BY, megatron.tp)
    dims = dims_from_hf_config(spec, config, padded)
    dp = world_size // (megatron.tp * megatron.pp)
    layout = Layout(tp=megatron.tp, pp=megatron.pp, ep=megatron.ep, vpp=megatron.vpp,
                    sp=megatron.sp, dp=dp)  # fmt: skip
    check_layout(dims, layout)


def transformer_config(dims: ModelDims, layout: Layout, dtype: torch.dtype, *, cpu: bool) -> Any:
    """megatron-core's TransformerConfig for ``dims`` under ``layout`` (fp32 or bf16 params);
    ``cpu``: the parameters are created on the CPU."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if dims.moe:
        moe = dict(
            num_moe_experts=dims.num_experts,
            moe_router_topk=dims.moe_topk,
            moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
            moe_router_pre_softmax=not dims.moe_norm_topk,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_shared_expert_intermediate_size=dims.moe_shared_ffn_hidden_size or None,
            moe_shared_expert_gate=dims.shared_experts,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.tp,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
        )
    return TransformerConfig(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        ffn_hidden_size=dims.ffn_hidden_size,
        kv_channels=dims.head_dim,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=layout.sp,
        use_cpu_initialization=cpu,
        # the HF weights overwrite every value, but megatron's layers only mark their
        # tensor-parallel attributes (which the grad norm and the optimizer read) when they
        # initialise: without it TP ranks > 0 drop out of the gradient norm
        perform_initialization=True,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        rotary_interleaved=dims.rotary_interleaved,
        calculate_per_token_loss=True,  # objectives give each micro-batch's share: sum them
        # gloo runs batched isend/irecv out of order: interleaved pipelines are silently wrong
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=False,
        **moe,
    )


def build_chunks(dims: ModelDims, config: Any, layout: Layout) -> list[Any]:
    """This rank's model chunks (one, or `vpp` virtual stages), weights uninitialised."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=dims.num_experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=dims.qk_norm,
        normalization="RMSNorm",
    )
    chunks = []
    for vp in range(layout.vpp or 1):
        stage = {"vp_stage": vp} if layout.vpp else {}
        chunks.append(
            GPTModel(
                config,
                spec,
                vocab_size=dims.padded_vocab_size,
                max_sequence_length=dims.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, **stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, **stage),
                share_embeddings_and_output_weights=dims.tied_embeddings,
                position_embedding_type="rope",
                rotary_base=int(dims.rope_theta),
                seq_len_interpolation_factor=dims.rope_scaling_factor,
                parallel_output=False,  # full-vocabulary logits on every TP rank
                **stage,
            )
        )
    return chunks


def keep_padding_row_frozen(chunks: list[Any], pad_token_id: int | None) -> None:
    """Transformers' embedding is ``nn.Embedding(padding_idx=pad_token_id)``: looking up the
    pad token gives its row no gradient (tied, the output layer's share still counts).
    megatron's VocabParallelEmbedding has no padding_idx: zero the gradient of its output at
    the pad token's positions, which is what padding_idx does."""
    from megatron.core import parallel_state as ps

    if pad_token_id is None:
        return

    def hook(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        ids = args[0]
        if not output.requires_grad:
            return
        pad = ids == pad_token_id  # [b, s]
        if getattr(module, "reduce_scatter_embeddings", False):  # [s / tp, b, h]: our part
            tp, rank = (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_tensor_model_parallel_rank(),
            )
            pad = pad.t().chunk(tp, dim=0)[rank]
        if pad.any():
            keep = (~pad).unsqueeze(-1).to(output.dtype)
            output.register_hook(lambda grad: grad * keep)

    for chunk in chunks:
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            embedding.word_embeddings.register_forward_hook(hook)


# ---- where each canonical parameter lives ----------------------------------------------------


def _tp_rank_size(key: KeyMap) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if key.per_expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def rank_place(dims: ModelDims, chunks: list[Any]) -> RankPlace:
    """This rank's place in the layout (saved with its checkpoint file, so `roll convert`
    assembles the shards offline with the same rules)."""
    from megatron.core import parallel_state as ps

    layers: dict[int, tuple[int, int]] = {}  # global layer -> (chunk, local index)
    for c, chunk in enumerate(chunks):
        for j, layer in enumerate(chunk.decoder.layers):
            layers[layer.layer_number - 1] = (c, j)
    n_local = dims.num_experts // ps.get_expert_model_parallel_world_size() if dims.moe else 0
    return RankPlace(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        layers=layers,
        n_local_experts=n_local,
        tied_embeddings=dims.tied_embeddings,
    )


class ShardMap:
    """Which of this rank's parameters holds which (canonical parameter, layer, expert): the
    rules of roll_core/convert/roll_megatron.py's RankPlace over this rank's chunks."""

    def __init__(self, dims: ModelDims, chunks: list[Any]) -> None:
        self.dims = dims
        self.steps = plan(dims)
        self.place = rank_place(dims, chunks)
        self.params = [dict(chunk.named_parameters()) for chunk in chunks]

    def locate(
        self, key: KeyMap, layer: int | None, expert: int | None, *, copies: bool = True
    ) -> list[torch.Tensor]:
        """This rank's tensors of the step, or []. ``copies``: with a tied embedding and PP,
        the last stage's copy of the embedding (`output_layer.weight`) too."""
        found = self.place.locate(key, layer, expert, self.params, copies=copies)
        return [self.params[chunk][name] for chunk, name in found]


@torch.no_grad()
def load_hf_weights(model_path: str, shards: ShardMap) -> None:
    """Copy every HF tensor of ``model_path`` into this rank's shards of it."""
    reader = HFReader(Path(model_path))
    produce = _producer(reader, shards.dims, {k.mcore: k for k, _, _ in shards.steps})
    for key, layer, expert in shards.steps:
        targets = shards.locate(key, layer, expert)
        if not targets:
            continue
        rank, size = _tp_rank_size(key)
        full = produce(key.mcore, layer, expert)
        part = split_tp(full, key.tp, size, name=key.mcore)[rank]
        for t in targets:
            if t.shape != part.shape:
                raise ConfigError(
                    f"{key.mcore} (layer {layer}) has shape {tuple(t.shape)} on this rank, the "
                    f"HF weights give {tuple(part.shape)}: the model does not fit the layout.",
                    hint="Check actor_train.megatron (tp, ep) against the model's config.json.",
                )
            t.copy_(part)


@torch.no_grad()
def iter_hf_tensors(shards: ShardMap) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the trained model, by HF name, assembled on global rank 0 (which
    yields them; the other ranks yield nothing). A collective: every rank iterates it, one
    gathered parameter at a time (never the whole model on one rank beyond one tensor)."""
    rank = dist.get_rank()
    for key, layer, expert in shards.steps:
        mine = shards.locate(key, layer, expert, copies=False)
        payload = None
        if mine and shards.place.owns(key):
            payload = (shards.place.tp_rank_of(key), mine[0].detach().cpu().clone())
        gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
        dist.gather_object(payload, gathered if rank == 0 else None, dst=0)
        if rank != 0:
            continue
        parts = sorted((p for p in gathered if p is not None), key=lambda p: p[0])
        full = merge_tp([t for _, t in parts], key.tp, name=key.mcore)
        yield from zip(hf_names(key, layer, expert), to_hf(key, full, shards.dims), strict=True)
