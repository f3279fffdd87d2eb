"""Policy losses: values, metrics and gradients against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from roll_core.algorithms import POLICY_LOSSES, policy_loss, rollout_correction
from roll_core.config.algorithm import AlgorithmConfig
from roll_core.errors import ConfigError

F64 = torch.float64
ln = math.log


def leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64, requires_grad=True)


def f64(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# PPO batch: old log-probs 0, so the ratio r is exp(log_probs). The padding slot has r = 9.
PPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
PPO_RATIOS = [[1.5, 0.5, 1.1], [0.7, 4.0, 9.0]]
PPO_ADV = f64([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])


def ppo_inputs() -> dict[str, torch.Tensor]:
    return {
        "log_probs": leaf([[ln(r) for r in row] for row in PPO_RATIOS]),
        "old_log_probs": torch.zeros(2, 3, dtype=F64),
        "advantages": PPO_ADV,
        "response_mask": PPO_MASK,
    }


def test_ppo_clip_higher() -> None:
    # range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]; loss = max(-A r, -A clip(r))
    # A = 1:  r 1.5 -> max(-1.5, -1.28) = -1.28 (clipped) ; r 0.5 -> max(-0.5, -0.8) = -0.5 ;
    #         r 1.1 -> -1.1
    # A = -2: r 0.7 -> max(1.4, 1.6) = 1.6 (clipped) ; r 4.0 -> max(8.0, 2.56) = 8.0
    # token-mean = (-1.28 - 0.5 - 1.1 + 1.6 + 8.0) / 5 = 6.72 / 5 = 1.344
    x = ppo_inputs()
    loss, metrics = policy_loss("ppo", **x, clip_low=0.2, clip_high=0.28)
    assert_close(loss, torch.tensor(1.344, dtype=F64))
    assert metrics["actor/pg_loss"] == pytest.approx(1.344)
    assert metrics["actor/clipfrac"] == pytest.approx(2 / 5)
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 0.7 + ln 4) / 5
    kl = -(ln(1.5) + ln(0.5) + ln(1.1) + ln(0.7) + ln(4.0)) / 5
    assert metrics["actor/ppo_kl"] == pytest.approx(kl)
    assert "actor/clipfrac_lower" not in metrics
    loss.backward()
    # d/dlogp of -A r is -A r; clipped tokens get 0; divided by 5 tokens
    grad = f64([[0.0, -0.5 / 5, -1.1 / 5], [0.0, 2 * 4.0 / 5, 0.0]])
    assert_close(x["log_probs"].grad, grad)


def test_ppo_dual_clip() -> None:
    # clip_c = 3: tokens with A < 0 take min(loss, -A * 3 = 6): 1.6 stays, 8.0 -> 6
    # token-mean = (-1.28 - 0.5 - 1.1 + 1.6 + 6.0) / 5 = 4.72 / 5 = 0.944
    x = ppo_inputs()
    loss, metrics = policy_loss("ppo", **x, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    assert_close(loss, torch.tensor(0.944, dtype=F64))
    assert metrics["actor/clipfrac_lower"] == pytest.approx(1 / 5)
    loss.backward()
    assert float(x["log_probs"].grad[1, 1]) == 0.0  # the dual-clipped token has no gradient


def test_ppo_seq_mean_token_mean() -> None:
    # row 0: (-1.28 - 0.5 - 1.1) / 3 = -0.96 ; row 1: (1.6 + 8.0) / 2 = 4.8 ; mean 1.92
    loss, _ = policy_loss(
        "ppo", **ppo_inputs(), clip_low=0.2, clip_high=0.28, agg_mode="seq-mean-token-mean"
    )
    assert_close(loss, torch.tensor(1.92, dtype=F64))


def test_ppo_bad_dual_clip_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="greater than 1"):
        policy_loss("ppo", **ppo_inputs(), clip_c=0.5)


def test_gspo_sequence_ratio_is_clipped_as_a_whole() -> None:
    # row 0: log-ratios 0.2, 0.0 -> mean 0.1 -> s = e^0.1 = 1.10517 ; A = 1 ; range [0.95, 1.05]
    #        loss per token max(-1.10517, -1.05) = -1.05 (clipped, both tokens)
    # row 1: log-ratio -0.02 -> s = e^-0.02 = 0.98020 ; A = -1 -> loss 0.98020 (inside the range)
    # seq-mean-token-mean: (-1.05 + 0.98020) / 2
    x = {
        "log_probs": leaf([[0.2, 0.0], [-0.02, 5.0]]),
        "old_log_probs": torch.zeros(2, 2, dtype=F64),
        "advantages": f64([[1.0, 1.0], [-1.0, -1.0]]),
        "response_mask": torch.tensor([[1, 1], [1, 0]]),
    }
    loss, metrics = policy_loss(
        "gspo", **x, clip_low=0.05, clip_high=0.05, agg_mode="seq-mean-token-mean"
    )
    s1 = math.exp(-0.02)
    assert_close(loss, torch.tensor((-1.05 + s1) / 2, dtype=F64))
    assert metrics["actor/clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    # clipped row: no gradient ; row 1: d(-A s)/dlogp = s, times 1/1 token times 1/2 sequences
    assert_close(x["log_probs"].grad, f64([[0.0, 0.0], [s1 / 2, 0.0]]))


def test_gspo_gradient_is_spread_over_the_sequence() -> None:
    # log-ratios 0.02, 0.0 -> s = e^0.01 (inside [0.95, 1.05]) ; A = 1
    # GSPO: grad of -s * A w.r.t. each token's logp = -s / |y| = -e^0.01 / 2 for both tokens,
    # even though only the first token's probability changed.
    x = {
        "log_probs": leaf([[0.02, 0.0]]),
        "old_log_probs": torch.zeros(1, 2, dtype=F64),
        "advantages": f64([[1.0, 1.0]]),
        "response_mask": torch.ones(1, 2),
    }
    loss, _ = policy_loss(
        "gspo", **x, clip_low=0.05, clip_high=0.05, agg_mode="seq-mean-token-mean"
    )
    loss.backward()
    g = -math.exp(0.01) / 2
    assert_close(x["log_probs"].grad, f64([[g, g]]))


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    # clip_low 1 (no lower bound), clip_high 0.28: weight = clip(r, 0, 1.28), no gradient
    # row 0 (A = 1):  r 2.0 -> w 1.28 (clipped) ; r 0.5 -> w 0.5
    # row 1 (A = -1): r 1.1 -> w 1.1
    # values -A w: -1.28, -0.5, 1.1 -> token-mean -0.68 / 3
    x = {
        "log_probs": leaf([[ln(2.0), ln(0.5)], [ln(1.1), 0.0]]),
        "old_log_probs": torch.zeros(2, 2, dtype=F64),
        "advantages": f64([[1.0, 1.0], [-1.0, -1.0]]),
        "response_mask": torch.tensor([[1, 1], [1, 0]]),
    }
    loss, metrics = policy_loss("cispo", **x, clip_low=1.0, clip_high=0.28)
    assert_close(loss, torch.tensor(-0.68 / 3, dtype=F64))
    assert metrics["actor/clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # gradient -A w / 3 tokens: the clipped token keeps -1.28 / 3 (PPO would give it 0)
    assert_close(x["log_probs"].grad, f64([[-1.28 / 3, -0.5 / 3], [1.1 / 3, 0.0]]))


def test_topr_tapers_only_negative_samples() -> None:
    # row 0 A = +1, sequence log-ratio 0.3 + 0.4 = 0.7 -> weight 1 (positives: no IS)
    # row 1 A = -1, sequence log-ratio 0.7 -> weight min(e^0.7, 1) = 1 (truncated)
    # row 2 A = -1, sequence log-ratio -0.5 - 0.2 = -0.7 -> weight e^-0.7
    # values -A w: -1, -1 | 1, 1 | e^-0.7, e^-0.7 ; token-mean = 2 e^-0.7 / 6
    w = math.exp(-0.7)
    x = {
        "log_probs": leaf([[0.3, 0.4], [0.3, 0.4], [-0.5, -0.2]]),
        "old_log_probs": torch.zeros(3, 2, dtype=F64),
        "advantages": f64([[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]]),
        "response_mask": torch.ones(3, 2),
    }
    loss, metrics = policy_loss("topr", **x)
    assert_close(loss, torch.tensor(2 * w / 6, dtype=F64))
    assert metrics["actor/clipfrac"] == pytest.approx(2 / 6)
    loss.backward()
    assert_close(x["log_probs"].grad, f64([[-1 / 6, -1 / 6], [1 / 6, 1 / 6], [w / 6, w / 6]]))
    # seq-mean-token-sum (the topr preset): (-2 + 2 + 2 e^-0.7) / 3 sequences
    loss2, _ = policy_loss("topr", **x, agg_mode="seq-mean-token-sum")
    assert_close(loss2, torch.tensor(2 * w / 3, dtype=F64))


def test_vanilla_pg() -> None:
    # value -A, gradient -A / 3 tokens, padding ignored
    x = {
        "log_probs": leaf([[-1.0, -2.0], [-0.5, -9.0]]),
        "old_log_probs": f64([[-1.5, -2.0], [-0.5, 0.0]]),
        "advantages": f64([[2.0, 2.0], [-1.0, 7.0]]),
        "response_mask": torch.tensor([[1, 1], [1, 0]]),
    }
    loss, metrics = policy_loss("pg", **x)
    assert_close(loss, torch.tensor((-2 - 2 + 1) / 3, dtype=F64))
    # ppo_kl = mean(old - new) = (-0.5 + 0 + 0) / 3
    assert metrics["actor/ppo_kl"] == pytest.approx(-0.5 / 3)
    loss.backward()
    assert_close(x["log_probs"].grad, f64([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))


def test_truncated_importance_sampling() -> None:
    # algorithm.tis_cap: 2 is rollout_correction {is_level: token, is_cap: 2}: the weights come
    # from the rollout correction and multiply each token's loss.
    # ratio 1 (new = old), A = 1 -> token loss -1 ; TIS weight min(exp(old - infer), 2):
    # exp(ln 3) = 3 -> 2 (capped) ; exp(ln 0.5) = 0.5 ; token-mean of -w = -(2 + 0.5) / 2
    x = {
        "log_probs": leaf([[0.0, 0.0]]),
        "old_log_probs": f64([[0.0, 0.0]]),
        "advantages": f64([[1.0, 1.0]]),
        "response_mask": torch.ones(1, 2),
    }
    infer = f64([[-ln(3.0), -ln(0.5)]])
    rc = AlgorithmConfig(tis_cap=2.0).rollout_correction
    assert rc is not None
    weights, mask, metrics = rollout_correction(
        old_log_probs=x["old_log_probs"],
        rollout_log_probs=infer,
        response_mask=x["response_mask"],
        **rc.kwargs(),
    )
    assert torch.equal(mask, x["response_mask"])
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    loss, _ = policy_loss("ppo", **x, rollout_is_weights=weights)
    assert_close(loss, torch.tensor(-1.25, dtype=F64))
    loss.backward()
    assert_close(x["log_probs"].grad, f64([[-2 / 2, -0.5 / 2]]))


def test_one_call_site_serves_every_loss() -> None:
    params = {"clip_low": 0.2, "clip_high": 0.28, "clip_c": None}
    for name in POLICY_LOSSES:
        x = ppo_inputs()
        loss, metrics = policy_loss(name, **x, **params)
        assert torch.isfinite(loss) and "actor/pg_loss" in metrics, name
        loss.backward()
        assert float(x["log_probs"].grad[1, 2]) == 0.0, f"{name}: padding got a gradient"


def test_unknown_loss_and_typo_in_a_parameter() -> None:
    with pytest.raises(ConfigError) as info:
        policy_loss("gsop", **ppo_inputs())
    assert "unknown policy loss 'gsop'. Did you mean 'gspo'?" in info.value.message
    assert "ppo, gspo, cispo, topr, pg" in (info.value.hint or "")
    with pytest.raises(TypeError, match="clip_hihg"):
        policy_loss("ppo", **ppo_inputs(), clip_hihg=0.3)
