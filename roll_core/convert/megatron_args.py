"""Megatron-LM arguments that change a GPT model's forward pass, beyond the shape.

:data:`REFUSED_UNLESS` lists every argument (of Megatron-LM 0.16 / megatron-core 0.16's
``TransformerConfig``) that makes the model compute something a supported Hugging Face
architecture cannot, with the values that are safe; :func:`check_math_args` refuses a checkpoint
whose args hold anything else, by name. The arguments that *are* mapped (the shape, RMSNorm
epsilon, RoPE base, ``rotary_interleaved``, ``rotary_seq_len_interpolation_factor``, the MoE
routing) are read in :func:`roll_core.convert.archs.dims_from_args`; the ones checked and found
not to change the math (precision, fusion, parallelism, training-only) are in
:data:`NO_MATH_EFFECT`, which docs/convert.md reproduces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Argument -> the values that keep the model an HF-expressible one (an absent argument or
#: ``None`` counts as Megatron's default, which is always listed). Several Megatron-LM names
#: for one setting (``apply_layernorm_1p`` is ``layernorm_zero_centered_gamma``) are all listed.
REFUSED_UNLESS: Mapping[str, tuple[Any, ...]] = {
    # residual / norm variants
    "apply_residual_connection_post_layernorm": (False,),
    "apply_layernorm_1p": (False,),
    "layernorm_zero_centered_gamma": (False,),
    # activations other than SwiGLU
    "squared_relu": (False,),
    "quick_geglu": (False,),
    "glu_linear_offset": (0.0, 0),
    "activation_func_clamp_value": (None,),
    # attention variants
    "window_size": (None,),
    "window_attn_skip_freq": (None,),
    "softmax_scale": (None,),
    "softmax_type": ("vanilla",),
    "qk_l2_norm": (False,),
    "attention_output_gate": (False,),
    "multi_latent_attention": (False,),
    "experimental_attention_variant": (None,),
    "linear_attention_freq": (None,),
    "no_rope_freq": (None,),
    # other model families and custom layers
    "is_hybrid_model": (False,),
    "hybrid_override_pattern": (None,),
    "heterogeneous_layers_config_path": (None,),
    "heterogeneous_block_specs": (False,),
    "spec": (None,),
    "mtp_num_layers": (None, 0),
}

#: MoE arguments that change routing or the expert computation at inference.
MOE_REFUSED_UNLESS: Mapping[str, tuple[Any, ...]] = {
    "moe_expert_capacity_factor": (None,),
    "moe_token_dropping": (False,),
    "moe_router_topk_limited_devices": (None,),
    "moe_router_group_topk": (None,),
    "moe_apply_probs_on_input": (False,),
    "moe_router_force_load_balancing": (False,),
    "moe_latent_size": (None,),
}

#: Arguments checked and left alone: they change precision, speed, memory or training only.
NO_MATH_EFFECT: Mapping[str, str] = {
    "apply_query_key_layer_scaling": "divides the scores by the layer number and multiplies "
    "them back inside the softmax: the same function",
    "attention_softmax_in_fp32, fp32_residual_connection, bf16, fp16, params_dtype, fp8*, fp4*, "
    "first_last_layers_bf16, moe_router_dtype, batch_invariant_mode": "precision only",
    "hidden_dropout, attention_dropout, moe_input_jitter_eps, moe_z_loss_coeff, "
    "moe_aux_loss_coeff, moe_router_bias_update_rate, qk_clip, init_method_std": "training only",
    "*_fusion, apply_rope_fusion, attention_backend, moe_grouped_gemm, "
    "moe_token_dispatcher_type, moe_shared_expert_overlap, recompute_*, cuda_graph_*": "speed or "
    "memory only (the same function)",
    "tensor/pipeline/expert/context_parallel_size, sequence_parallel, "
    "num_layers_in_first/last_pipeline_stage, pipeline_model_parallel_layout": "the layout of "
    "the files, which the readers follow",
}


def check_math_args(args: Mapping[str, Any], moe: bool) -> list[str]:
    """``name=value (supported: ...)`` for each argument whose value the converter cannot map."""
    table = {**REFUSED_UNLESS, **(MOE_REFUSED_UNLESS if moe else {})}
    return [
        f"{k}={args[k]!r} (supported: {', '.join(map(repr, allowed))})"
        for k, allowed in table.items()
        if args.get(k) is not None and args[k] not in allowed
    ]


def interpolation_factor(args: Mapping[str, Any]) -> float | None:
    """``rotary_seq_len_interpolation_factor`` (None when unset or 1: positions unscaled)."""
    value = args.get("rotary_seq_len_interpolation_factor")
    if value is None:
        return None
    factor = float(value)
    return None if factor == 1.0 else factor
