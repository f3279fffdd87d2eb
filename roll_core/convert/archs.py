"""Architectures the converter knows, as data: how each is recognised, its Hugging Face config
and its parameter names on both sides.

Everything that differs between Llama, Qwen2/2.5, Qwen3, Qwen3-MoE and Qwen2-MoE is in
:data:`ARCHS` and the key tables; the code that uses them (:mod:`roll_core.convert.convert`)
has no per-architecture branch.

Three vocabularies meet here:

* Megatron-LM training arguments (``args`` in the checkpoint): ``num_query_groups``,
  ``kv_channels``, ``untie_embeddings_and_output_weights``, ...
* :class:`ModelDims`: the neutral description both sides are mapped to and from;
* the Hugging Face ``config.json`` keys: ``num_key_value_heads``, ``head_dim``, ...

Parameter names use the *canonical Megatron name*: the key a ``torch_dist`` checkpoint uses
(``decoder.layers.`` + a per-layer name such as ``self_attention.linear_qkv.weight``, with the
layer norms fused into the following linear layer as Transformer Engine names them). The
legacy layout of a model built with Megatron's local (non-TE) layers names two of them
differently; :data:`LOCAL_NAMES` maps those (and :data:`DIST_LOCAL_NAMES` the one name a local
MoE layer has in ``torch_dist``).

Mixture-of-experts layers (Qwen3-MoE) replace the dense MLP by a router and ``num_experts``
SwiGLU experts. An expert parameter has one more index, the *global* expert id ``e``: in
``torch_dist`` the tensor is stacked ``[layer, expert, ...]``
(``decoder.layers.mlp.experts.experts.linear_fc1.weight``); in the legacy layout expert ``e``
lives in the file of expert-parallel rank ``e // num_local_experts`` as local expert
``e % num_local_experts`` (:data:`LEGACY_EXPERT_NAMES`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from roll_core.convert.megatron_args import check_math_args, interpolation_factor
from roll_core.errors import CheckpointError, UsageError


@dataclass(frozen=True)
class ModelDims:
    """The shape of a dense decoder-only transformer, independent of either format."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """The real vocabulary (the Hugging Face one); Megatron pads it (``padded_vocab_size``)."""
    padded_vocab_size: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: bool = False
    """Every layer's MLP is a mixture of experts (the fields below are 0 for a dense model)."""
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    """The hidden size of one expert."""
    moe_topk: int = 0
    """Experts per token."""
    moe_norm_topk: bool = True
    """Routing weights are the softmax over the top-k logits (renormalised), not over all."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss weight (used in training only)."""
    shared_experts: bool = False
    """An MoE layer also has a shared expert, gated by ``sigmoid(x @ gate)`` (Qwen2-MoE)."""
    moe_shared_ffn_hidden_size: int = 0
    rotary_interleaved: bool = False
    """Megatron's interleaved RoPE (pairs ``(2i, 2i+1)``); mcore2hf reorders q/k rows for HF."""
    rope_scaling_factor: float | None = None
    """Linear RoPE scaling (positions divided by it): Megatron's
    ``rotary_seq_len_interpolation_factor``, HF's ``rope_scaling`` of type ``linear``."""


#: Megatron-LM argument -> ModelDims field (the plain renames; derived ones are in code below).
ARG_TO_DIMS: Mapping[str, str] = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_heads",
    "norm_epsilon": "norm_eps",
    "rotary_base": "rope_theta",
    "max_position_embeddings": "max_position_embeddings",
    "padded_vocab_size": "padded_vocab_size",
    "add_qkv_bias": "qkv_bias",
    "qk_layernorm": "qk_norm",
}

#: Megatron-LM MoE argument -> ModelDims field (read when ``num_experts`` is set).
MOE_ARG_TO_DIMS: Mapping[str, str] = {
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_topk",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff",
}

#: Megatron-LM arguments a model with shared experts needs (Qwen2-MoE's gated shared expert).
SHARED_EXPERT_REQUIRED_ARGS: Mapping[str, Any] = {"moe_shared_expert_gate": True}

#: Megatron-LM arguments every supported architecture needs, with the value it must have.
REQUIRED_ARGS: Mapping[str, Any] = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "rotary_percent": 1.0,
    "use_rope_scaling": False,
    "virtual_pipeline_model_parallel_size": None,
}

#: Megatron-LM arguments a mixture-of-experts model needs (Qwen-MoE routing: softmax, top-k,
#: no expert bias, every layer MoE), with the value it must have (a tuple: one of these).
#: Sinkhorn balancing routes differently at inference, so it is refused.
MOE_REQUIRED_ARGS: Mapping[str, Any] = {
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": None,
    "moe_layer_freq": 1,
    "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
}

#: Defaults of Megatron-LM arguments an old checkpoint may lack.
ARG_DEFAULTS: Mapping[str, Any] = {
    "norm_epsilon": 1e-5,
    "rotary_base": 10000,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "group_query_attention": False,
    "normalization": "LayerNorm",
    "swiglu": False,
    "position_embedding_type": "learned_absolute",
    "add_bias_linear": True,
    "num_experts": None,
    "rotary_percent": 1.0,
    "use_rope_scaling": False,
    "virtual_pipeline_model_parallel_size": None,
    "untie_embeddings_and_output_weights": False,
    "moe_router_topk": 2,
    "moe_router_pre_softmax": False,
    "moe_aux_loss_coeff": 0.0,
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_layer_freq": 1,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_shared_expert_gate": False,
    "expert_model_parallel_size": 1,
    "make_vocab_size_divisible_by": 128,
    "transformer_impl": "transformer_engine",
}


@dataclass(frozen=True)
class KeyMap:
    """One Megatron parameter and the Hugging Face tensors it is made of.

    ``kind`` names the rule that converts between them (see :mod:`roll_core.convert.tensors`):
    ``copy`` (one tensor, unchanged), ``qkv`` (q, k, v interleaved by query group),
    ``gate_up`` (gate and up stacked), ``vocab`` (one tensor, vocabulary padding added or
    removed), ``head`` (one per-head tensor, reordered for interleaved rotary). ``tp`` names the tensor-parallel rule: ``replicated``, ``column``, ``row``,
    ``gated_column`` or ``vocab``. ``when`` is a ModelDims flag that must be true for the
    parameter to exist (``qkv_bias``, ``qk_norm``, ``moe``, ``untied``; ``!moe``: false).
    ``per_expert``: one tensor per expert; the HF names hold ``{e}``, the global expert id.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"
    tp: str = "replicated"
    when: str | None = None
    per_expert: bool = False


#: Parameters outside the transformer layers (Megatron name -> HF names).
GLOBAL_KEYS: tuple[KeyMap, ...] = (
    KeyMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "vocab"),
    KeyMap("decoder.final_layernorm.weight", ("model.norm.weight",)),
    KeyMap("output_layer.weight", ("lm_head.weight",), "vocab", "vocab", when="untied"),
)

#: Parameters of transformer layer ``{i}`` (canonical Megatron name -> HF names).
LAYER_KEYS: tuple[KeyMap, ...] = (
    KeyMap("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
    KeyMap(
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
        "column",
    ),
    KeyMap(
        "self_attention.linear_qkv.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
        "column",
        when="qkv_bias",
    ),
    KeyMap(
        "self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "head", when="qk_norm"
    ),
    KeyMap(
        "self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "head", when="qk_norm"
    ),
    KeyMap("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), tp="row"),
    # dense MLP (the pre-MLP norm is fused into linear_fc1 by Transformer Engine)
    KeyMap("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",), when="!moe"),
    KeyMap(
        "mlp.linear_fc1.weight",
        ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "gate_up",
        "gated_column",
        when="!moe",
    ),
    KeyMap("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), tp="row", when="!moe"),
    # mixture of experts (Megatron keeps the pre-MLP norm a module of its own here)
    KeyMap("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), when="moe"),
    KeyMap("mlp.router.weight", ("mlp.gate.weight",), when="moe"),
    KeyMap(
        "mlp.experts.experts.linear_fc1.weight",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "gate_up",
        "gated_column",
        when="moe",
        per_expert=True,
    ),
    KeyMap(
        "mlp.experts.experts.linear_fc2.weight",
        ("mlp.experts.{e}.down_proj.weight",),
        tp="row",
        when="moe",
        per_expert=True,
    ),
    # the shared expert of Qwen2-MoE and its sigmoid gate
    KeyMap(
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        "gate_up",
        "gated_column",
        when="shared_experts",
    ),
    KeyMap(
        "mlp.shared_experts.linear_fc2.weight",
        ("mlp.shared_expert.down_proj.weight",),
        tp="row",
        when="shared_experts",
    ),
    KeyMap(
        "mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), when="shared_experts"
    ),
)

HF_LAYER_PREFIX = "model.layers.{i}."
MCORE_LAYER_PREFIX = "decoder.layers."

#: Legacy-layout names of Megatron's local (non-Transformer-Engine) layers, per canonical name.
LOCAL_NAMES: Mapping[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

#: ``torch_dist`` name of a canonical parameter in a model of local (non-TE) layers, where it
#: differs: a local MoE layer's pre-MLP norm is stored under the dense MLP's TE name.
DIST_LOCAL_NAMES: Mapping[str, str] = {
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}

#: Legacy names of expert parameters (``{e}``: the local expert id), per canonical name;
#: the first is written (SequentialMLP, Megatron's default), all are read (the second is
#: Transformer Engine's grouped GEMM, ``TEGroupedMLP``; ``torch_dist`` stores both alike).
LEGACY_EXPERT_NAMES: Mapping[str, tuple[str, ...]] = {
    "mlp.experts.experts.linear_fc1.weight": (
        "mlp.experts.local_experts.{e}.linear_fc1.weight",
        "mlp.experts.linear_fc1.weight{e}",
    ),
    "mlp.experts.experts.linear_fc2.weight": (
        "mlp.experts.local_experts.{e}.linear_fc2.weight",
        "mlp.experts.linear_fc2.weight{e}",
    ),
    "mlp.experts.experts.linear_fc1": ("mlp.experts.local_experts.{e}.linear_fc1",),
    "mlp.experts.experts.linear_fc2": ("mlp.experts.local_experts.{e}.linear_fc2",),
}


@dataclass(frozen=True)
class ExtraState:
    """A module with an ``_extra_state`` entry (legacy) / sharded object (torch_dist).

    Megatron's strict loaders expect them; their value is ``None``. ``impls``: the layer
    implementations that have it; ``when`` and ``per_expert`` as in :class:`KeyMap`.
    """

    module: str
    impls: tuple[str, ...] = ("local", "transformer_engine")
    when: str | None = None
    per_expert: bool = False


EXTRA_STATES: tuple[ExtraState, ...] = (
    ExtraState("self_attention.linear_proj"),
    ExtraState("self_attention.linear_qkv"),
    ExtraState("self_attention.core_attention", impls=("transformer_engine",)),
    ExtraState("mlp.linear_fc1", when="!moe"),
    ExtraState("mlp.linear_fc2", when="!moe"),
    ExtraState("mlp.experts.experts.linear_fc1", when="moe", per_expert=True),
    ExtraState("mlp.experts.experts.linear_fc2", when="moe", per_expert=True),
    ExtraState("mlp.shared_experts.linear_fc1", when="shared_experts"),
    ExtraState("mlp.shared_experts.linear_fc2", when="shared_experts"),
)
TRANSFORMER_IMPLS = ("transformer_engine", "local")


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: how to recognise it and how its HF config is written and read."""

    name: str
    model_type: str
    architecture: str
    flags: Mapping[str, bool]
    """ModelDims flags that identify it (``qkv_bias``, ``qk_norm``, ``moe``)."""
    hf_config: Mapping[str, str]
    """HF config key -> ModelDims field."""
    hf_constants: Mapping[str, Any] = field(default_factory=dict)
    """HF config keys with a fixed value for this architecture."""
    description: str = ""
    hf_aliases: Mapping[str, str] = field(default_factory=dict)
    """Other names of ``hf_config`` keys (transformers 5 writes ``num_local_experts`` for
    Qwen3-MoE's ``num_experts``); read when the key itself is absent."""


_COMMON_HF_CONFIG: Mapping[str, str] = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tied_embeddings",
}

#: HF config keys of a mixture-of-experts model (Qwen2-MoE / Qwen3-MoE names).
_MOE_HF_CONFIG: Mapping[str, str] = {
    "num_experts": "num_experts",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "num_experts_per_tok": "moe_topk",
    "norm_topk_prob": "moe_norm_topk",
    "router_aux_loss_coef": "moe_aux_loss_coeff",
}

ARCHS: Mapping[str, ArchSpec] = {
    a.name: a
    for a in (
        ArchSpec(
            "llama",
            "llama",
            "LlamaForCausalLM",
            {"qkv_bias": False, "qk_norm": False, "moe": False},
            _COMMON_HF_CONFIG,
            {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
            "Llama 2/3 (no biases, RMSNorm, SwiGLU, RoPE, GQA)",
        ),
        ArchSpec(
            "qwen2",
            "qwen2",
            "Qwen2ForCausalLM",
            {"qkv_bias": True, "qk_norm": False, "moe": False},
            {k: v for k, v in _COMMON_HF_CONFIG.items() if k != "head_dim"},
            {"hidden_act": "silu", "use_sliding_window": False},
            "Qwen2 / Qwen2.5 (bias on q, k, v)",
        ),
        ArchSpec(
            "qwen3",
            "qwen3",
            "Qwen3ForCausalLM",
            {"qkv_bias": False, "qk_norm": True, "moe": False},
            _COMMON_HF_CONFIG,
            {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
            "Qwen3 dense (RMSNorm on q and k per head)",
        ),
        ArchSpec(
            "qwen3_moe",
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            {"qkv_bias": False, "qk_norm": True, "moe": True, "shared_experts": False},
            {**_COMMON_HF_CONFIG, **_MOE_HF_CONFIG},
            {
                "hidden_act": "silu",
                "attention_bias": False,
                "use_sliding_window": False,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            },
            "Qwen3-MoE (Qwen3 attention, every MLP a top-k mixture of experts)",
            {"num_experts": "num_local_experts"},
        ),
        ArchSpec(
            "qwen2_moe",
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            {"qkv_bias": True, "qk_norm": False, "moe": True, "shared_experts": True},
            {
                **{k: v for k, v in _COMMON_HF_CONFIG.items() if k != "head_dim"},
                **_MOE_HF_CONFIG,
                "shared_expert_intermediate_size": "moe_shared_ffn_hidden_size",
            },
            {
                "hidden_act": "silu",
                "use_sliding_window": False,
                "qkv_bias": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            },
            "Qwen1.5-MoE / Qwen2-MoE (Qwen2 attention, experts plus a gated shared expert)",
        ),
    )
}


def supported() -> str:
    """``llama (Llama 2/3 ...), qwen2 (...), ...`` for error messages and docs."""
    return ", ".join(f"{a.name} ({a.description})" for a in ARCHS.values())


def get_arch(name: str) -> ArchSpec:
    """The spec of architecture ``name`` (a roll name or a HF ``model_type``)."""
    for spec in ARCHS.values():
        if name in (spec.name, spec.model_type):
            return spec
    raise UsageError(
        f"architecture '{name}' is not supported. Supported: {supported()}.",
        hint="Pick one with --arch, or convert a checkpoint of a supported architecture.",
    )


def detect_arch(dims: ModelDims) -> ArchSpec:
    """The architecture whose identifying flags match ``dims``."""
    for spec in ARCHS.values():
        if all(getattr(dims, k) == v for k, v in spec.flags.items()):
            return spec
    found = ", ".join(
        f"{k}={getattr(dims, k)}" for k in ("qkv_bias", "qk_norm", "moe", "shared_experts")
    )
    raise CheckpointError(
        f"no supported architecture has {found}. Supported: {supported()}.",
        hint="Pass --arch or --hf-config to say which architecture this is.",
    )


# -- Megatron args <-> ModelDims -------------------------------------------------------------


def dims_from_args(args: Mapping[str, Any], *, vocab_size: int | None) -> ModelDims:
    """ModelDims from Megatron-LM training arguments (checks the features they use)."""
    a = dict(ARG_DEFAULTS)
    a.update({k: v for k, v in args.items() if v is not None})
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if a.get(k) is None]
    if missing:
        raise CheckpointError(
            f"the checkpoint's args lack {', '.join(missing)}, so the model shape is unknown.",
            hint="This does not look like a Megatron-LM GPT checkpoint; check SRC.",
        )
    moe = a.get("num_experts") is not None
    if moe and _all_moe_layers(a.get("moe_layer_freq")):
        a["moe_layer_freq"] = 1
    shared = moe and a.get("moe_shared_expert_intermediate_size") is not None
    required = {
        **REQUIRED_ARGS,
        **(MOE_REQUIRED_ARGS if moe else {}),
        **(SHARED_EXPERT_REQUIRED_ARGS if shared else {}),
    }
    unsupported = [
        f"{k}={a.get(k)!r} (supported: {', '.join(map(repr, _allowed(v)))})"
        for k, v in required.items()
        if a.get(k, ARG_DEFAULTS.get(k)) not in _allowed(v)
    ]
    unsupported += check_math_args(a, moe)
    factor = interpolation_factor(a)
    if factor is not None and factor <= 0:
        unsupported.append(f"rotary_seq_len_interpolation_factor={factor!r} (must be positive)")
    if unsupported:
        raise CheckpointError(
            "the checkpoint uses features the converter does not support: "
            + "; ".join(unsupported)
            + f". Supported architectures: {supported()}.",
            hint="LayerNorm, learned positions, linear biases, Llama-3 rope scaling, virtual "
            "pipeline stages, ungated shared experts, expert bias, grouped or sigmoid routing, "
            "models that mix dense and MoE layers and the attention and activation variants "
            "named above are not converted (docs/convert.md lists what is).",
        )
    values: dict[str, Any] = {dst: a.get(src) for src, dst in ARG_TO_DIMS.items()}
    heads = int(a["num_attention_heads"])
    hidden = int(a["hidden_size"])
    values["num_kv_heads"] = int(a["num_query_groups"]) if a["group_query_attention"] else heads
    values["head_dim"] = int(a.get("kv_channels") or hidden // heads)
    values["ffn_hidden_size"] = int(a.get("ffn_hidden_size") or 4 * hidden)
    values["tied_embeddings"] = not a["untie_embeddings_and_output_weights"]
    values["max_position_embeddings"] = int(
        a.get("max_position_embeddings") or a.get("seq_length") or 4096
    )
    padded = a.get("padded_vocab_size")
    if padded is None:
        raise CheckpointError(
            "the checkpoint's args lack padded_vocab_size.",
            hint="Pass --hf-config with the model's config.json.",
        )
    values["vocab_size"] = int(vocab_size or a.get("vocab_size") or padded)
    values["rotary_interleaved"] = bool(a.get("rotary_interleaved"))
    values["rope_scaling_factor"] = factor
    if moe:
        values.update({dst: a.get(src) for src, dst in MOE_ARG_TO_DIMS.items()})
        values["moe"] = True
        values["moe_ffn_hidden_size"] = int(
            a.get("moe_ffn_hidden_size") or values["ffn_hidden_size"]
        )
        values["moe_norm_topk"] = not a["moe_router_pre_softmax"]
        coeff = a.get("moe_aux_loss_coeff") or 0.0
        values["moe_aux_loss_coeff"] = float(coeff[0] if isinstance(coeff, list) else coeff)
        values["shared_experts"] = shared
        values["moe_shared_ffn_hidden_size"] = int(
            a.get("moe_shared_expert_intermediate_size") or 0
        )
    return ModelDims(**values)


def _allowed(value: Any) -> tuple[Any, ...]:
    """The values a REQUIRED_ARGS entry allows (a tuple lists several)."""
    return value if isinstance(value, tuple) else (value,)


def _all_moe_layers(freq: Any) -> bool:
    """Whether Megatron's ``moe_layer_freq`` (an int or a per-layer 0/1 list) means every layer."""
    return freq == 1 or (isinstance(freq, (list, tuple)) and all(f == 1 for f in freq))


def args_from_dims(
    dims: ModelDims,
    *,
    tp: int,
    pp: int,
    transformer_impl: str,
    dtype: str,
    divisible_by: int,
    ep: int = 1,
) -> dict[str, Any]:
    """Megatron-LM training arguments that describe ``dims`` (stored as ``args``)."""
    import torch

    args = {src: getattr(dims, dst) for src, dst in ARG_TO_DIMS.items()}
    args.update(REQUIRED_ARGS)
    args["num_experts"] = None
    if dims.moe:
        args.update({src: getattr(dims, dst) for src, dst in MOE_ARG_TO_DIMS.items()})
        args.update({k: v for k, v in MOE_REQUIRED_ARGS.items() if not isinstance(v, tuple)})
        args.update(
            moe_router_pre_softmax=not dims.moe_norm_topk,
            moe_router_load_balancing_type="aux_loss",
            moe_grouped_gemm=False,
            expert_tensor_parallel_size=tp,
            moe_shared_expert_intermediate_size=dims.moe_shared_ffn_hidden_size or None,
            moe_shared_expert_gate=dims.shared_experts,
        )
    args.update(
        num_query_groups=dims.num_kv_heads,
        group_query_attention=dims.num_kv_heads != dims.num_heads,
        kv_channels=dims.head_dim,
        untie_embeddings_and_output_weights=not dims.tied_embeddings,
        vocab_size=dims.vocab_size,
        make_vocab_size_divisible_by=divisible_by,
        seq_length=dims.max_position_embeddings,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        transformer_impl=transformer_impl,
        params_dtype=getattr(torch, dtype),
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        rotary_interleaved=False,
        rotary_seq_len_interpolation_factor=dims.rope_scaling_factor,
    )
    return args


# -- HF config <-> ModelDims -----------------------------------------------------------------


def hf_config_from_dims(
    spec: ArchSpec, dims: ModelDims, dtype: str, token_ids: Mapping[str, int | None] | None = None
) -> dict[str, Any]:
    """The ``config.json`` of ``dims`` for ``spec``, completed by transformers' config class.

    ``token_ids`` (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) come from the
    tokenizer when one is given; Megatron's args do not record them.
    """
    from transformers import AutoConfig

    fields = {key: getattr(dims, attr) for key, attr in spec.hf_config.items()}
    ids = {k: v for k, v in (token_ids or {}).items() if v is not None}
    scaling = _linear_scaling(dims)
    config = AutoConfig.for_model(
        spec.model_type, **fields, **spec.hf_constants, **ids, dtype=dtype,
        **({"rope_scaling": dict(scaling)} if scaling else {}),
    )  # fmt: skip
    out: dict[str, Any] = config.to_diff_dict()
    out["architectures"] = [spec.architecture]
    # transformers 5 keeps rope_theta inside rope_parameters; transformers 4 (and engines
    # built on it) read the top-level key.
    out["rope_theta"] = dims.rope_theta
    if scaling:
        out["rope_scaling"] = {"type": "linear", **scaling}
    out["torch_dtype"] = dtype
    # ... and the key names of transformers 4 where transformers 5 renamed them
    # (Qwen3-MoE's num_experts is num_local_experts in transformers 5's config.json)
    for key, alias in spec.hf_aliases.items():
        if alias in out:
            out[key] = out[alias]
    return out


def _linear_scaling(dims: ModelDims) -> dict[str, Any]:
    f = dims.rope_scaling_factor
    return {"rope_type": "linear", "factor": f} if f else {}


def _hf_rope_scaling(config: Mapping[str, Any]) -> float | None:
    """The factor of linear rope scaling (None without scaling); other types are refused."""
    scaling = config.get("rope_scaling") or (config.get("rope_parameters") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return None
    factor = scaling.get("factor")
    if kind == "linear" and isinstance(factor, (int, float)) and factor > 0:
        return None if factor == 1 else float(factor)
    raise UsageError(
        f"the model uses rope scaling {scaling}; the converter supports plain RoPE and linear "
        "scaling with a positive factor only.",
        hint="docs/convert.md lists what is supported.",
    )


def _hf_rope_theta(config: Mapping[str, Any]) -> Any:
    params = config.get("rope_parameters") or {}
    return params.get("rope_theta", config.get("rope_theta", 10000.0))


#: HF config keys a ``config.json`` may leave out (transformers' default applies).
_DEFAULTED_HF_KEYS = ("norm_topk_prob", "router_aux_loss_coef", "num_experts_per_tok")


@functools.cache
def _default_hf_config(model_type: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def dims_from_hf_config(spec: ArchSpec, config: Mapping[str, Any], padded_vocab: int) -> ModelDims:
    """ModelDims from a Hugging Face ``config.json`` (the inverse of :func:`hf_config_from_dims`)."""
    factor = _hf_rope_scaling(config)
    for key, value in spec.hf_constants.items():
        if key in config and config[key] != value:
            raise UsageError(
                f"the model's config has {key}={config[key]!r}; a {spec.name} model the converter "
                f"supports has {key}={value!r}.",
                hint=f"Supported: {supported()}.",
            )
    values: dict[str, Any] = {}
    for key, attr in spec.hf_config.items():
        value = config.get(key, config.get(spec.hf_aliases.get(key, key)))
        if value is None and key in _DEFAULTED_HF_KEYS:  # as transformers reads the file
            value = getattr(_default_hf_config(spec.model_type), key, None)
        values[attr] = _hf_rope_theta(config) if key == "rope_theta" else value
    heads = int(values["num_heads"])
    values["num_kv_heads"] = int(values.get("num_kv_heads") or heads)
    values["head_dim"] = int(values.get("head_dim") or int(values["hidden_size"]) // heads)
    values["tied_embeddings"] = bool(config.get("tie_word_embeddings", False))
    values["padded_vocab_size"] = padded_vocab
    values.update(spec.flags)
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise UsageError(
            f"the model's config.json lacks {', '.join(missing)}.",
            hint="Pass a complete Hugging Face config (save it with save_pretrained).",
        )
    return ModelDims(**values, rope_scaling_factor=factor)


def key_applies(key: KeyMap | ExtraState, dims: ModelDims) -> bool:
    """Whether parameter ``key`` exists in a model of shape ``dims``."""
    if key.when is None:
        return True
    if key.when == "untied":
        return not dims.tied_embeddings
    if key.when.startswith("!"):
        return not getattr(dims, key.when[1:])
    return bool(getattr(dims, key.when))


def mcore_shape(name: str, dims: ModelDims) -> tuple[int, ...]:
    """The global shape of canonical Megatron parameter ``name`` in a model of shape ``dims``."""
    h, d, f = dims.hidden_size, dims.head_dim, dims.moe_ffn_hidden_size
    qkv = (dims.num_heads + 2 * dims.num_kv_heads) * d
    shapes: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (dims.padded_vocab_size, h),
        "output_layer.weight": (dims.padded_vocab_size, h),
        "decoder.final_layernorm.weight": (h,),
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": (qkv, h),
        "self_attention.linear_qkv.bias": (qkv,),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, dims.num_heads * d),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (2 * dims.ffn_hidden_size, h),
        "mlp.linear_fc2.weight": (h, dims.ffn_hidden_size),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.router.weight": (dims.num_experts, h),
        "mlp.experts.experts.linear_fc1.weight": (2 * f, h),  # one expert
        "mlp.experts.experts.linear_fc2.weight": (h, f),
        "mlp.shared_experts.linear_fc1.weight": (2 * dims.moe_shared_ffn_hidden_size, h),
        "mlp.shared_experts.linear_fc2.weight": (h, dims.moe_shared_ffn_hidden_size),
        "mlp.shared_experts.gate_weight": (1, h),
    }
    return shapes[name]


#: ModelDims fields that describe the weights and the positions (compared between args and a
#: given HF config).
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "tied_embeddings",
    "qkv_bias",
    "qk_norm",
    "moe",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_topk",
    "moe_norm_topk",
    "shared_experts",
    "moe_shared_ffn_hidden_size",
    "rope_theta",
    "rope_scaling_factor",
)


def check_dims(spec: ArchSpec, dims: ModelDims) -> None:
    """Refuse a shape ``spec``'s HF config cannot express."""
    if dims.moe and dims.moe_topk == 1 and dims.moe_norm_topk:
        raise UsageError(
            "top-1 routing with renormalised weights (HF norm_topk_prob=true; Megatron without "
            "--moe-router-pre-softmax) gives every token the weight 1 in HF but not in "
            "Megatron, which refuses it.",
            hint="Use norm_topk_prob=false (Megatron: --moe-router-pre-softmax) for top-1 routing.",
        )
    wrong = [f"{k}={getattr(dims, k)}" for k, v in spec.flags.items() if getattr(dims, k) != v]
    if wrong:
        raise UsageError(
            f"a {spec.name} model has {', '.join(f'{k}={v}' for k, v in spec.flags.items())}; "
            f"this checkpoint has {', '.join(wrong)}.",
            hint=f"Leave out --arch to detect it, or pick the right one. Supported: {supported()}.",
        )
    if "head_dim" not in spec.hf_config and dims.head_dim * dims.num_heads != dims.hidden_size:
        raise UsageError(
            f"a {spec.name} config cannot express head size {dims.head_dim} with "
            f"{dims.num_heads} heads and hidden size {dims.hidden_size}.",
            hint="Use an architecture whose config has head_dim (llama, qwen3).",
        )
