"""The built-in losses of the Tinker API (``forward_backward(data, loss_fn)``), as `roll serve`
computes them.

Each takes one datum's tensors, all ``[N]`` (N: the datum's input tokens): ``logprobs``, the
log-probability under the trained model of ``target_tokens[i]`` at position ``i`` (carries the
gradient), and the datum's ``loss_fn_inputs`` by name; it returns the datum's **summed** loss
(Tinker sums over tokens and data; the client scales by its own weights) and the per-token
loss. Names and semantics follow the client's documentation (tinker 0.38.0, ``LossFnType``):

* ``cross_entropy``: ``-sum(weights * logp)`` (inputs ``target_tokens``, ``weights``).
* ``importance_sampling``: ``-sum(exp(logp - q) * A)`` where ``q`` are the sampler's
  log-probs (``logprobs``) and ``A`` the ``advantages``: REINFORCE with an importance ratio,
  equal to roll's ``ppo`` policy loss with no clipping summed over tokens (tested).
* ``ppo``: ``-sum(min(r * A, clip(r, low, high) * A))``, ``r = exp(logp - q)``;
  ``loss_fn_config`` ``clip_low_threshold`` (0.8) and ``clip_high_threshold`` (1.2) are the
  ratio bounds themselves (not ``1 -+ eps``).
* ``cispo``: ``-sum(sg(clip(r, low, high)) * logp * A)`` (MiniMax-M1, arXiv 2506.13585), the
  same thresholds.

Departure from roll's policy losses: no log-ratio clamp (Tinker has none), and no
aggregation choice (always the sum).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

LossFn = Callable[..., torch.Tensor]


def cross_entropy(*, logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``-weights * logp`` [N]."""
    return -weights * logprobs


def importance_sampling(
    *, logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """Per-token loss ``-exp(logp - q) * A`` [N]."""
    return -torch.exp(logprobs - sampling_logprobs) * advantages


def ppo(
    *,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
) -> torch.Tensor:
    """Per-token clipped surrogate ``-min(r*A, clip(r, low, high)*A)`` [N]."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(
    *,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
) -> torch.Tensor:
    """Per-token ``-sg(clip(r, low, high)) * logp * A`` [N]."""
    ratio = torch.exp(logprobs - sampling_logprobs).detach()
    return -ratio.clamp(clip_low_threshold, clip_high_threshold) * logprobs * advantages


TINKER_LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
}
"""Built-in Tinker losses served, by the client's name."""

CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
}
"""The ``loss_fn_config`` keys each loss takes (the others take none)."""

INPUTS: dict[str, dict[str, str]] = {
    "cross_entropy": {"weights": "weights"},
    "importance_sampling": {"logprobs": "sampling_logprobs", "advantages": "advantages"},
    "ppo": {"logprobs": "sampling_logprobs", "advantages": "advantages"},
    "cispo": {"logprobs": "sampling_logprobs", "advantages": "advantages"},
}
"""Each loss's ``loss_fn_inputs`` (besides ``target_tokens``) -> its keyword argument."""


def datum_loss(
    name: str,
    *,
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
) -> torch.Tensor:
    """The per-token loss [N] of loss `name` on one datum. `inputs`: its ``loss_fn_inputs``
    (float tensors [N]); a missing one is a KeyError naming it; `config`: the request's
    ``loss_fn_config`` (only this loss's keys; others are a ValueError)."""
    fn = TINKER_LOSSES[name]
    allowed = CONFIG_KEYS.get(name, ())
    extra = sorted(set(config) - set(allowed))
    if extra:
        raise ValueError(
            f"loss_fn_config key {extra[0]!r} is not a parameter of {name} "
            f"(its parameters: {', '.join(allowed) or 'none'})"
        )
    kwargs: dict[str, object] = {k: float(v) for k, v in config.items()}
    for key, arg in INPUTS[name].items():
        if key not in inputs:
            raise KeyError(key)
        kwargs[arg] = inputs[key].to(logprobs.dtype)
    return fn(logprobs=logprobs, **kwargs)
