"""LR multipliers, checked against hand-computed values."""

import math

import pytest
import torch

from roll_core.backends.train.schedules import adamw_kwargs, lr_multiplier, make_optimizer
from roll_core.config.schema import OptimConfig


def test_warmup_is_linear_from_first_step() -> None:
    # warmup 4: steps 0..3 -> 1/4, 2/4, 3/4, 4/4
    got = [lr_multiplier(s, warmup_steps=4, total_steps=10, kind="cosine") for s in range(4)]
    assert got == [0.25, 0.5, 0.75, 1.0]


def test_cosine_hits_min_ratio_at_last_step() -> None:
    # warmup 2, total 12: decay over steps 2..11 (span 9); step 2 -> 1, step 11 -> min_ratio
    assert lr_multiplier(2, warmup_steps=2, total_steps=12, kind="cosine", min_ratio=0.1) == 1.0
    assert lr_multiplier(
        11, warmup_steps=2, total_steps=12, kind="cosine", min_ratio=0.1
    ) == pytest.approx(0.1)
    # midpoint progress 0.5 at step 2 + 4.5 -> not integral; use total 11 (span 8): step 6
    mid = lr_multiplier(6, warmup_steps=2, total_steps=11, kind="cosine", min_ratio=0.0)
    assert mid == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))  # 0.5


def test_linear_and_constant() -> None:
    # no warmup, total 5: span 4; step 1 -> 1 - 1/4 = 0.75
    assert lr_multiplier(1, warmup_steps=0, total_steps=5, kind="linear") == 0.75
    assert lr_multiplier(3, warmup_steps=0, total_steps=5, kind="constant") == 1.0


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="valid: cosine, linear, constant"):
        lr_multiplier(5, warmup_steps=0, total_steps=10, kind="exp")


def test_make_optimizer_carries_the_section_and_schedules_it() -> None:
    optim = OptimConfig(
        lr=0.4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, warmup_steps=2, scheduler="linear"
    )
    param = torch.nn.Parameter(torch.zeros(3))
    opt, sched = make_optimizer([param], optim, total_steps=4)
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.1)
    lrs = []
    for _ in range(4):  # warmup 1/2, 2/2; linear decay over steps 2..3 (span 1): 1, 0
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.2, 0.4, 0.4, 0.0])


def _adamw_run(optimizer_of) -> list[torch.Tensor]:
    """Three AdamW steps on two parameters with fixed gradients; the final values."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((7, 5), (5,))]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(3)]
    opt = optimizer_of(params)
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def test_default_adamw_is_bitwise_the_per_parameter_loop() -> None:
    """make_optimizer's multi-tensor AdamW equals torch's per-parameter loop bit for bit;
    `optim.fused` is equal up to float32 rounding (a few ulps of values near 1)."""
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    loop = _adamw_run(lambda ps: torch.optim.AdamW(ps, **adamw_kwargs(optim), foreach=False))
    ours = _adamw_run(lambda ps: make_optimizer(ps, optim, 10)[0])
    assert all(torch.equal(a, b) for a, b in zip(loop, ours, strict=True))
    fused_cfg = OptimConfig(lr=1e-2, weight_decay=0.1, fused=True)
    fused = _adamw_run(lambda ps: make_optimizer(ps, fused_cfg, 10)[0])
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(loop, fused, strict=True))
