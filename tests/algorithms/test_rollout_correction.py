"""Rollout correction by hand: importance weights, rejection masks, metrics, aggregation.

One batch throughout: the sampler's log-probs are -1 everywhere and the trainer's are
``-1 + log(rho)``, so the token ratios ``rho = pi_old / pi_rollout`` are

    row 0: 2, 0.5, 1      (3 response tokens)
    row 1: 4, 1, [8]      (2 response tokens, the 8 is padding)
    row 2: [3, 3, 3]      (no response token: a fully masked row)

and ``d = log(rho)``. Every expected number below is derived in the comments from these.
"""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms import policy_loss, rollout_correction
from roll_core.algorithms.rollout_correction import divergence_mask, importance_weights
from roll_core.errors import ConfigError

LN2, LN4 = math.log(2.0), math.log(4.0)
RHO = torch.tensor([[2.0, 0.5, 1.0], [4.0, 1.0, 8.0], [3.0, 3.0, 3.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float64)
ROLLOUT = torch.full_like(RHO, -1.0)
OLD = ROLLOUT + torch.log(RHO)


def correct(**kwargs):
    return rollout_correction(
        old_log_probs=OLD, rollout_log_probs=ROLLOUT, response_mask=MASK, **kwargs
    )


def test_mismatch_metrics() -> None:
    _, mask, m = correct()
    assert torch.equal(mask, MASK)  # nothing configured: nothing rejected
    # kl = mean(-d) = -(ln2 - ln2 + 0 + ln4 + 0) / 5 = -ln4 / 5
    assert m["rollout_corr/kl"] == pytest.approx(-LN4 / 5)
    # k3 per token = rho - 1 - d: (1 - ln2) + (-0.5 + ln2) + 0 + (3 - ln4) + 0 = 3.5 - ln4
    assert m["rollout_corr/k3_kl"] == pytest.approx((3.5 - LN4) / 5)
    # rho over the 5 tokens: sum 8.5, sum of squares 4 + 0.25 + 1 + 16 + 1 = 22.25
    assert m["rollout_corr/ratio_mean"] == pytest.approx(8.5 / 5)
    assert m["rollout_corr/ratio_min"] == pytest.approx(0.5)
    assert m["rollout_corr/ratio_max"] == pytest.approx(4.0)
    assert m["rollout_corr/ess"] == pytest.approx(8.5**2 / (5 * 22.25))  # 0.6494
    assert m["rollout_corr/chi2_token"] == pytest.approx(22.25 / 5 - 1)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0


def test_token_tis() -> None:
    w, _, m = correct(is_level="token", is_cap=3.0)
    # min(rho, 3) on response tokens, 0 elsewhere
    expected = torch.tensor([[2.0, 0.5, 1.0], [3.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(w, expected.double())
    # mean / max / min of the applied weights 2, .5, 1, 3, 1 (as current verl): 7.5 / 5, 3, .5
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    # untruncated ratios above 3: the 4 (1 of 5); below 1/3: none
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.2)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0
    # ESS of the applied weights: sum 7.5, squares 4 + .25 + 1 + 9 + 1 = 15.25
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(7.5**2 / (5 * 15.25))


def test_token_tis_ess_uses_the_applied_weights() -> None:
    w, _, m = correct(is_level="token", is_cap=1.5)
    # applied weights min(rho, 1.5): 1.5, .5, 1 | 1.5, 1 -> sum 5.5, squares 6.75
    assert torch.allclose(w[:2], torch.tensor([[1.5, 0.5, 1.0], [1.5, 1.0, 0.0]]).double())
    # ESS = 5.5^2 / (5 * 6.75) = 0.8963 (verl before 2026 clamped to [1/cap, cap] first, so the
    # .5 would count as 2/3 there: 5.667^2 / (5 * 6.944) = 0.9248)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(5.5**2 / (5 * 6.75))
    # raw ratios above 1.5: 2 and 4 (2 of 5); below 1/1.5: the .5 (1 of 5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.4)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.2)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(5.5 / 5)


def test_token_icepop() -> None:
    w, mask, m = correct(is_level="token", is_cap=3.0, is_low=0.6)
    # rho 2, .5, 1 | 4, 1: the .5 (< .6) and the 4 (> 3) get weight 0, the rest keep rho
    expected = torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(w, expected.double())
    assert torch.equal(mask, MASK)  # IcePop weights, it does not reject
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    # applied weights 2, 0, 1, 0, 1: mean 4 / 5, max 2, min 0; ESS 4^2 / (5 * 6)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(0.8)
    assert (m["rollout_corr/rollout_is_max"], m["rollout_corr/rollout_is_min"]) == (2.0, 0.0)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(16 / 30)
    # raw above 3: the 4; below .6 (the lower bound, not 1 / cap): the .5
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.2)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.2)
    # in the loss the zeroed tokens stay in the denominator: token-mean of -w over 5 tokens
    assert float(_pg_loss(w, mask, "token-mean")) == pytest.approx(-4 / 5)


def test_icepop_zeroing_every_weight_has_ess_zero_not_inf() -> None:
    # band [1.1, 1.5] holds none of 2, .5, 1 | 4, 1: every weight is 0, ESS 0 (not 1 / 0)
    w, _, m = correct(is_level="token", is_cap=1.5, is_low=1.1)
    assert float(w.abs().sum()) == 0.0
    assert m["rollout_corr/rollout_is_eff_sample_size"] == 0.0
    assert m["rollout_corr/rollout_is_oob_ratio"] == 1.0


def test_sequence_icepop() -> None:
    w, _, m = correct(is_level="sequence", is_cap=2.0, is_low=0.5)
    # row products 1 (inside [.5, 2]) and 4 (outside): row 1's weights become 0
    expected = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(w, expected.double())
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)  # row 1's 2 tokens
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5  # rows: 4 > 2
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0


def test_sequence_tis() -> None:
    w, _, m = correct(is_level="sequence", is_cap=2.0)
    # row products: 2 * 0.5 * 1 = 1, 4 * 1 = 4 (the padded 8 is not a factor) -> min(., 2)
    expected = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(w, expected.double())
    # applied 1, 1, 1, 2, 2 over the tokens: mean 7 / 5
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.4)
    # max / min of the untruncated row weights over the two rows with a response (the empty
    # row is not a sequence)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(4.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(1.0)
    # rows above 2: row 1 of 2
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5
    # ESS of the applied weights 1, 1, 1, 2, 2: sum 7, squares 11
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(49 / 55)


def test_geometric_weights_untruncated() -> None:
    w, _, m = correct(is_level="geometric", is_cap=None)
    # geometric means: (2 * 0.5 * 1)^(1/3) = 1, (4 * 1)^(1/2) = 2; no cap
    expected = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(w, expected.double())
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(7 / 5)
    assert "rollout_corr/rollout_is_ratio_fraction_high" not in m  # no cap, no fraction
    # ESS of the raw weights 1, 1, 1, 2, 2
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(49 / 55)


def test_sequence_weight_is_clamped_at_exp_20() -> None:
    # a row of 30 tokens with rho = e each: sum d = 30 > 20 -> weight exp(20), not exp(30)
    d = torch.ones(1, 30, dtype=torch.float64)
    w, _ = importance_weights(
        log_ratio=d, response_mask=torch.ones_like(d), level="sequence", cap=None
    )
    assert w[0, 0] == pytest.approx(math.exp(20.0))


@pytest.mark.parametrize(
    ("level", "low", "high", "kept"),
    [
        # token: keep rho in [1 / 2.5, 2.5] -> the 4 goes (row 1, token 0)
        ("token", None, 2.5, [[1, 1, 1], [0, 1, 0]]),
        # Yao et al.'s MIS: only an upper bound (low 0); 0.5 stays either way
        ("token", 0.0, 1.5, [[0, 1, 1], [0, 1, 0]]),
        # sequence: products 1 and 4; 4 > 2 -> row 1 goes
        ("sequence", None, 2.0, [[1, 1, 1], [0, 0, 0]]),
        # geometric: means 1 and 2; band [0.999, 1.001] keeps row 0 only
        ("geometric", 0.999, 1.001, [[1, 1, 1], [0, 0, 0]]),
        # geometric with [0.4, 2.5]: both stay
        ("geometric", 0.4, 2.5, [[1, 1, 1], [1, 1, 0]]),
    ],
)
def test_ratio_band_rejection(level: str, low, high: float, kept) -> None:
    _, mask, m = correct(rs_level=level, rs_low=low, rs_high=high)
    expected = torch.tensor([*kept, [0, 0, 0]], dtype=torch.float64)
    assert torch.equal(mask, expected)
    rejected_tokens = 5 - int(expected.sum())
    rejected_rows = sum(1 for r in range(2) if expected[r].sum() < MASK[r].sum())
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected_tokens / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(rejected_rows / 2)
    assert m[f"rollout_corr/rollout_rs_{level}_masked_fraction"] == pytest.approx(
        rejected_tokens / 5
    )


@pytest.mark.parametrize(
    ("option", "low", "high", "kept"),
    [
        # k1 = -d; kept when log(.4) <= -d <= log(2.5), i.e. rho in [.4, 2.5]: the 4 goes
        ("token_k1", None, 2.5, [[1, 1, 1], [0, 1, 0]]),
        # low .2, high 3: -d in [log .2, log 3] <=> rho in [1/3, 5]: all stay (the bounds are
        # on pi_rollout / pi_old = 1 / rho, as verl's k1 bounds)
        ("token_k1", 0.2, 3.0, [[1, 1, 1], [1, 1, 0]]),
        # -d in [log .45, log 4] <=> rho in [.25, 2.22]: the 4 goes
        ("token_k1", 0.45, 4.0, [[1, 1, 1], [0, 1, 0]]),
        # k3 = rho - 1 - d: .307, .193, 0 | 1.614, 0; <= .5 keeps all but the 4
        ("token_k3", None, 0.5, [[1, 1, 1], [0, 1, 0]]),
        # k2 = d^2 / 2: .240, .240, 0 | .961, 0; <= .2 drops both ln2 tokens and the 4
        ("token_k2", None, 0.2, [[0, 0, 1], [0, 1, 0]]),
        # seq_sum_k1: row sums of -d are 0 and -ln4 < log(.5): row 1 goes
        ("seq_sum_k1", None, 2.0, [[1, 1, 1], [0, 0, 0]]),
        # seq_sum_k3: .5 and 1.614; <= .6 keeps row 0
        ("seq_sum_k3", None, 0.6, [[1, 1, 1], [0, 0, 0]]),
        # seq_mean_k3: .5 / 3 = .167 and 1.614 / 2 = .807; <= .2 keeps row 0
        ("seq_mean_k3", None, 0.2, [[1, 1, 1], [0, 0, 0]]),
        # seq_mean_k2: .480 / 3 = .160 and .961 / 2 = .480; <= .5 keeps both
        ("seq_mean_k2", None, 0.5, [[1, 1, 1], [1, 1, 0]]),
        # seq_max_k2: .240 and .961; <= .2 rejects both rows
        ("seq_max_k2", None, 0.2, [[0, 0, 0], [0, 0, 0]]),
        # seq_max_k3: .307 and 1.614; <= 1 keeps row 0
        ("seq_max_k3", None, 1.0, [[1, 1, 1], [0, 0, 0]]),
    ],
)
def test_divergence_rejection(option: str, low, high: float, kept) -> None:
    _, mask, m = correct(rs_divergence=[(option, low, high)])
    assert torch.equal(mask, torch.tensor([*kept, [0, 0, 0]], dtype=torch.float64))
    assert f"rollout_corr/rollout_rs_{option}_masked_fraction" in m


def test_criteria_combine_with_and() -> None:
    # token band [.4, 2.5] drops the 4; token_k2 <= .2 drops the two ln2 tokens too
    _, mask, m = correct(rs_level="token", rs_high=2.5, rs_divergence=[("token_k2", None, 0.2)])
    assert torch.equal(mask[:2], torch.tensor([[0, 0, 1], [0, 1, 0]], dtype=torch.float64))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_token_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_rs_token_k2_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0


def test_seq_max_of_a_fully_masked_row_is_zero_not_minus_inf() -> None:
    # row 2 has no token: its statistic is 0, which passes any positive bound (and is unused)
    keep = divergence_mask(
        log_ratio=torch.log(RHO), response_mask=MASK, option="seq_max_k3", high=1
    )
    assert keep[2].tolist() == [1.0, 1.0, 1.0]


def test_empty_batch_gives_no_metrics_and_no_nan() -> None:
    empty = torch.zeros_like(MASK)
    w, mask, m = rollout_correction(
        old_log_probs=OLD, rollout_log_probs=ROLLOUT, response_mask=empty, is_level="token"
    )
    assert m == {} and torch.equal(mask, empty) and float(w.abs().sum()) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"is_level": "tokne"}, "Did you mean 'token'?"),
        ({"rs_level": "geometrc", "rs_high": 2.0}, "Did you mean 'geometric'?"),
        ({"rs_divergence": [("seq_mean_k4", None, 1.0)]}, "Did you mean 'seq_mean_k3'?"),
        ({"rs_level": "token", "rs_low": 2.0, "rs_high": 2.0}, "band [2.0, 2.0]"),
        ({"rs_divergence": [("token_k1", 3.0, 2.0)]}, "band [3.0, 2.0]"),
        ({"rs_divergence": [("token_k3", 0.1, 2.0)]}, "only applies to k1"),
        ({"is_level": "token", "is_cap": 0.0}, "must be positive"),
        ({"is_level": "token", "is_cap": 2.0, "is_low": 2.0}, "band [2.0, 2.0]"),
        ({"is_level": "token", "is_cap": None, "is_low": 0.5}, "needs an upper bound"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        correct(**kwargs)
    assert fragment in str(info.value)


# -- in the policy loss: each aggregation mode ------------------------------------------------


def _pg_loss(weights, mask, agg_mode: str) -> torch.Tensor:
    """`pg` has loss value -A * w per token; with A = 1 the token loss is -w."""
    logp = torch.full((3, 3), -1.0, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        "pg",
        log_probs=logp,
        old_log_probs=logp.detach(),
        advantages=torch.ones(3, 3, dtype=torch.float64),
        response_mask=mask,
        agg_mode=agg_mode,
        max_len=3,
        rollout_is_weights=weights,
    )
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    return loss.detach()


def test_every_aggregation_mode_is_covered() -> None:
    from roll_core.algorithms.aggregation import LOSS_AGG_MODES

    modes = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    assert set(LOSS_AGG_MODES) == set(modes), "add the new mode to the two tests below"


@pytest.mark.parametrize(
    ("agg_mode", "expected"),
    [
        # kept tokens (token MIS: untruncated rho, band [0, 2.5]): 2, .5, 1 | 1 -> loss -w
        ("token-mean", -(2 + 0.5 + 1 + 1) / 4),  # the rejected 4 leaves the denominator
        ("seq-mean-token-mean", (-(3.5 / 3) - 1.0) / 2),  # row 1 has 1 kept token
        ("seq-mean-token-sum", (-3.5 - 1.0) / 2),
        ("seq-mean-token-sum-norm", -4.5 / (2 * 3)),  # constant length 3
    ],
)
def test_token_mis_in_every_aggregation(agg_mode: str, expected: float) -> None:
    w, mask, _ = correct(is_level="token", is_cap=None, rs_level="token", rs_low=0.0, rs_high=2.5)
    assert float(_pg_loss(w, mask, agg_mode)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("agg_mode", "expected"),
    [
        # sequence TIS + sequence rejection: row 1 (product 4) is rejected whole, row 0 has
        # weight 1 on 3 tokens; the rejected row is no sequence, the empty row neither
        ("token-mean", -3 / 3),
        ("seq-mean-token-mean", -1.0),
        ("seq-mean-token-sum", -3.0),
        ("seq-mean-token-sum-norm", -3 / 3),
    ],
)
def test_fully_rejected_row_in_every_aggregation(agg_mode: str, expected: float) -> None:
    w, mask, _ = correct(is_level="sequence", is_cap=2.0, rs_level="sequence", rs_high=2.0)
    assert mask[1].sum() == 0
    assert float(_pg_loss(w, mask, agg_mode)) == pytest.approx(expected)


def test_weights_with_decoupled_ppo_are_refused() -> None:
    x = dict(
        log_probs=OLD,
        old_log_probs=OLD,
        advantages=torch.ones_like(OLD),
        response_mask=MASK,
        infer_log_probs=ROLLOUT,
        rollout_is_weights=torch.ones_like(OLD),
    )
    with pytest.raises(ValueError, match="twice"):
        policy_loss("decoupled_ppo", **x)
    with pytest.raises(TypeError, match="tis_cap"):  # one path: tis_cap is a recipe alias
        policy_loss("ppo", **x, tis_cap=2.0)
