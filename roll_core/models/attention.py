"""Attention in float32 under bfloat16 autocast on CPU.

torch's CPU flash-attention kernel (what transformers' ``sdpa`` attention calls on CPU) is
several times slower in bfloat16 than in float32 in its backward pass: on the 2-core AMD EPYC
of docs/performance.md, 113-151 ms against 17 ms per layer for the tiny model's update of 128
rows (the forward costs the same in both). Under bf16 autocast on CPU, roll's train and hf
inference backends therefore run the attention itself (softmax(QK^T/sqrt(d))V) in float32:
the projections, MLPs and LM head stay in bfloat16, only the attention kernel's inputs are
upcast and its output cast back. `load_causal_lm` installs it, so every role of every roll
process computes the same way (trainer, sampler, reference, teacher, critic; any executor). That is also the more precise choice (mixed-precision
recipes keep the softmax in float32); it changes the numbers only within bf16 rounding.

Nothing changes off CPU (CUDA's bf16 flash-attention is fast) or outside autocast: the
wrapper is transformers' own ``sdpa`` function there, call for call.
"""

from __future__ import annotations

from typing import Any

import torch

_LOW = (torch.bfloat16, torch.float16)


def _float32_sdpa_on_cpu_autocast(sdpa: Any) -> Any:
    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if (
            query.device.type != "cpu"
            or not torch.is_autocast_enabled("cpu")
            or torch.get_autocast_dtype("cpu") not in _LOW
        ):
            return sdpa(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
        # autocast would run the kernel in its low dtype (the rotary embedding leaves query
        # and key in float32, the value projection gives bf16): float32 for all three instead
        with torch.autocast("cpu", enabled=False):
            out, weights = sdpa(
                module, query.float(), key.float(), value.float(), attention_mask, **kwargs
            )
        return out.to(torch.get_autocast_dtype("cpu")), weights

    attention.roll_float32_on_cpu = True  # type: ignore[attr-defined]
    attention.wrapped = sdpa  # type: ignore[attr-defined]
    return attention


def use_float32_attention_on_cpu_autocast() -> None:
    """Make transformers' ``sdpa`` attention run in float32 where CPU autocast is on (see the
    module docstring). Idempotent; autocast state is per thread, so a thread outside autocast
    (another role's generation) computes exactly as before."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not getattr(current, "roll_float32_on_cpu", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _float32_sdpa_on_cpu_autocast(current)
