"""The reward stage of a rollout: decode a sample, score it with the domain's reward.

Wraps the reward router (roll_core/rewards/) for the scheduler: it is called from the
scheduler's reward threads as each response completes; failures and timeouts become score 0
and are counted by the router.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from roll_core.config.reward import RewardConfig
from roll_core.rewards import RewardRouter, RewardSample, domain_metrics
from roll_core.rollout.one_turn import Sample


class RewardStage:
    """Scores rollout samples; thread-safe; its counters are part of the checkpoint."""

    def __init__(self, cfg: RewardConfig, *, tokenizer: Any, domains: Iterable[str | None]) -> None:
        self.router = RewardRouter.from_config(cfg, dataset_domains=domains)
        self.tokenizer = tokenizer

    def _reward_sample(self, sample: Sample) -> RewardSample:
        return RewardSample(
            prompt=self.tokenizer.decode(sample.prompt.prompt_ids),
            response=self.tokenizer.decode(sample.response_ids, skip_special_tokens=True),
            row=sample.prompt.row,
            num_tokens=len(sample.response_ids),
            finish_reason=sample.finish_reason,
        )

    def score_sample(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        rs = self._reward_sample(sample)
        result = self.router.score(rs)
        return result.score, {**result.info, "domain": self.router.domain_of(rs)}

    def step_metrics(self) -> dict[str, float]:
        """Per-domain reward metrics since the last call (errors, timeouts, accuracy)."""
        return self.router.metrics(reset=True)

    def eval_metrics(self, samples: list[Sample], *, prefix: str = "eval") -> dict[str, float]:
        """Accuracy and reward over `samples`, overall and per domain, under `prefix/`."""
        from roll_core.rewards import RewardResult

        results = [RewardResult(s.reward, s.reward_info) for s in samples]
        per_domain = domain_metrics([s.reward_info.get("domain") for s in samples], results)
        out = {f"{prefix}/{k.removeprefix('reward/')}": v for k, v in per_domain.items()}
        n = max(1, len(samples))
        out[f"{prefix}/reward_mean"] = sum(s.reward for s in samples) / n
        out[f"{prefix}/accuracy"] = sum(bool(s.reward_info.get("correct")) for s in samples) / n
        out[f"{prefix}/response_length_mean"] = sum(len(s.response_ids) for s in samples) / n
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.router.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.router.load_state_dict(state)

    def close(self) -> None:
        self.router.close()
