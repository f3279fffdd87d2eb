"""The algorithm library: pure tensor functions for RL post-training.

Advantage estimators, policy losses, loss aggregation, KL estimators and controllers, reward
and advantage normalisation, entropy, the value loss and DAPO's reward shaping. Every function
takes keyword arguments and tensors shaped ``[batch, resp_len]`` with a ``response_mask`` of
0/1; the losses return ``(loss, metrics)`` with namespaced metric keys. Nothing here knows about
Ray, workers or config objects. See docs/algorithms.md for one entry per paper.
"""

from roll_core.algorithms.advantages import ADV_ESTIMATORS, compute_advantages
from roll_core.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from roll_core.algorithms.entropy import entropy_bonus, entropy_from_logits
from roll_core.algorithms.functional import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    scores_to_token_rewards,
    sequence_scores,
)
from roll_core.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    kl_loss,
    make_kl_controller,
)
from roll_core.algorithms.normalization import (
    REWARD_NORMALIZERS,
    RunningMeanStd,
    clip_advantages,
    clip_rewards,
    normalize_rewards,
    whiten_advantages,
)
from roll_core.algorithms.policy_losses import POLICY_LOSSES, policy_loss
from roll_core.algorithms.rollout_correction import rollout_correction
from roll_core.algorithms.shaping import groups_with_signal, overlong_penalty
from roll_core.algorithms.value import explained_variance, value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "REWARD_NORMALIZERS",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMeanStd",
    "agg_loss",
    "apply_kl_penalty",
    "clip_advantages",
    "clip_rewards",
    "compute_advantages",
    "entropy_bonus",
    "entropy_from_logits",
    "explained_variance",
    "groups_with_signal",
    "kl_estimate",
    "kl_loss",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_rewards",
    "overlong_penalty",
    "policy_loss",
    "rollout_correction",
    "scores_to_token_rewards",
    "sequence_scores",
    "value_loss",
    "whiten_advantages",
]
