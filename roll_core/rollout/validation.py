"""Held-out prompts of `roll train rlvr`, generated once and scored: validation's samples.

Each prompt is one request (seed ``seed + prompt.index``), sent through the rollout's
router like every training request: in deterministic mode as fixed chunks of ``chunk``
requests (the same chunks whatever the ranks' load, so the same answers), in streaming mode
one by one to the least loaded rank, next to whatever the rollout has in flight (async). A
rank that dies is handled as for training requests. Validation requests carry negative ids
(``-1 - prompt.index``), apart from the training ones (1, 2, ...). The samples come back in
prompt order, each scored by ``score`` (the reward stage of validation) on the driver."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from roll_core.backends.infer import Request, SamplingParams
from roll_core.data.prompts import Prompt
from roll_core.rollout.one_turn import Sample
from roll_core.rollout.router import Router


def score_prompts(
    router: Router,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    score: Callable[[Sample], tuple[float, dict[str, Any]]],
    *,
    seed: int,
    chunk: int,
) -> list[Sample]:
    """One scored sample per prompt of ``prompts`` (see the module docstring)."""
    futures = []
    for i in range(0, len(prompts), chunk):
        reqs = [
            Request(-1 - p.index, p.prompt_ids, seed=seed + p.index, vision=p.vision)
            for p in prompts[i : i + chunk]
        ]
        futures += router.submit_batch(reqs, params)
    completions = [f.result() for f in futures]
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
