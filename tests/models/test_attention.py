"""Float32 attention under bf16 autocast on CPU (roll_core/models/attention.py)."""

from __future__ import annotations

import math

import torch

from roll_core.models import load_causal_lm
from roll_core.models.attention import (
    _float32_sdpa_on_cpu_autocast,
    use_float32_attention_on_cpu_autocast,
)


def recording_sdpa(seen: list) -> object:
    def sdpa(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202
        seen.append((query.dtype, key.dtype, value.dtype, torch.is_autocast_enabled("cpu")))
        return torch.nn.functional.scaled_dot_product_attention(query, key, value), None

    return sdpa


def qkv(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    # one head, two positions, d = 2: q0 = q1 = (1, 0); k0 = (0, 0), k1 = (2 ln 2 * sqrt 2, 0)
    # -> scores (0, 2 ln 2): softmax (1/5, 4/5); v0 = (1, 0), v1 = (0, 1) -> out (0.2, 0.8)
    q = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]], dtype=dtype)
    k = torch.tensor([[[[0.0, 0.0], [2 * math.log(2) * math.sqrt(2), 0.0]]]], dtype=dtype)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=dtype)
    return q, k, v


def test_under_cpu_bf16_autocast_the_kernel_gets_float32_and_returns_bf16() -> None:
    seen: list = []
    attention = _float32_sdpa_on_cpu_autocast(recording_sdpa(seen))
    q, k, v = qkv(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(None, q, k, v.to(torch.bfloat16), None)  # rope leaves q, k float32
    assert seen == [(torch.float32, torch.float32, torch.float32, False)]
    assert out.dtype == torch.bfloat16
    # 0.2 and 0.8 rounded to bf16 (8 significant bits): 0.2001953125, 0.80078125
    assert out[0, 0].float().tolist() == [[0.2001953125, 0.80078125]] * 2


def test_outside_autocast_it_is_the_wrapped_function_call_for_call() -> None:
    seen: list = []
    attention = _float32_sdpa_on_cpu_autocast(recording_sdpa(seen))
    q, k, v = qkv(torch.bfloat16)
    out, _ = attention(None, q, k, v, None)
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.bfloat16, False)]
    assert out.dtype == torch.bfloat16


def test_install_is_idempotent_and_model_loading_installs_it() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    load_causal_lm("builtin:tiny-qwen3")
    first = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert getattr(first, "roll_float32_on_cpu", False)
    use_float32_attention_on_cpu_autocast()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is first  # not wrapped twice


def test_tiny_model_gradients_match_float32_attention_more_closely() -> None:
    # the whole model under bf16 autocast: with the float32 attention its input gradients
    # are at least as close to the float32 model's as with the bf16 kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = load_causal_lm("builtin:tiny-qwen3")
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    wrapped = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def grads(autocast: bool) -> torch.Tensor:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    exact = grads(False)
    ours = grads(True)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapped.wrapped  # transformers' own: the bf16 kernel
    try:
        plain = grads(True)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapped
    assert not torch.equal(ours, plain)  # the wrapper did change the computation
    assert (ours - exact).norm() <= (plain - exact).norm() * 1.05
