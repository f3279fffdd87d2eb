"""Held-out prompts of `roll train rlvr`, generated once and scored: validation's samples.

Each prompt is one request (seed ``seed + prompt.index``), sent in chunks of ``chunk``
requests round-robin over the inference ranks; the samples come back in prompt order, each
scored by ``score`` (the reward stage of validation) on the driver."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from roll_core.backends.infer import Request, SamplingParams
from roll_core.data.prompts import Prompt
from roll_core.engine import Cluster
from roll_core.rollout.scheduler import Sample


def score_prompts(
    infer: Cluster,
    prompts: list[Prompt],
    params: SamplingParams,
    score: Callable[[Sample], tuple[float, dict[str, Any]]],
    *,
    seed: int,
    chunk: int,
) -> list[Sample]:
    """One scored sample per prompt of ``prompts`` (see the module docstring)."""
    futures = []
    for k, i in enumerate(range(0, len(prompts), chunk)):
        reqs = [
            Request(p.index, p.prompt_ids, seed=seed + p.index, vision=p.vision)
            for p in prompts[i : i + chunk]
        ]
        futures.append(infer.at(k % infer.world_size).generate(reqs, params))
    completions = [c for f in futures for c in f.result()]
    scored = []
    for p, c in zip(prompts, completions, strict=True):
        sample = Sample(
            uid=p.index,
            group=p.index,
            prompt=p,
            response_ids=c.response_ids,
            log_probs=c.log_probs,
            finish_reason=c.finish_reason,
            policy_version=c.policy_version,
        )
        sample.reward, sample.reward_info = score(sample)
        scored.append(sample)
    return scored
