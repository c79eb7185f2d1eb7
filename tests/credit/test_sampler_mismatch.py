"""The sampler -> scorer mismatch and the rollout correction's weights, against numbers worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from comppo_jax.credit import rollout_correction_weights, sampler_mismatch

# Two responses: r = pi_score / pi_sample of 0.25, 1, 3 and of 1.5, 2.5; padding holds garbage (NaN).
RATIOS = np.array([[0.25, 1.0, 3.0, np.nan], [1.5, 2.5, np.nan, np.nan]])
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
SAMPLER = np.where(MASK, np.log([[0.4, 0.5, 0.1, 0.3], [0.6, 0.2, 0.5, 0.5]]), np.nan)


def log_probs(ratios=RATIOS, sampler=SAMPLER):
    """(sampler, scorer) float32 log-probs whose ratio is `ratios` on the valid tokens, NaN on padding."""
    return sampler.astype(np.float32), (sampler + np.log(ratios)).astype(np.float32)


def test_the_mismatch_is_the_k3_kl_the_log_ratios_and_the_fraction_outside_half_to_two_by_hand():
    got = {name: float(value) for name, value in sampler_mismatch(*log_probs(), MASK).items()}
    # sum(r - 1) = 3.25 and sum(log r) = log(0.25 * 1 * 3 * 1.5 * 2.5) = log(2.8125), over 5 tokens.
    assert got["kl"] == pytest.approx((3.25 - np.log(2.8125)) / 5, rel=1e-5)
    # |log r|: log 4, 0, log 3, log 1.5, log 2.5; their sum is log(4 * 3 * 1.5 * 2.5) = log 45.
    assert got["abs_log_ratio_mean"] == pytest.approx(np.log(45.0) / 5, rel=1e-5)
    assert got["abs_log_ratio_max"] == pytest.approx(np.log(4.0), rel=1e-5)
    assert got["ratio_outside_half_to_two"] == pytest.approx(3 / 5)  # 0.25, 3 and 2.5


def test_the_mismatch_of_equal_log_probs_is_zero_and_of_an_empty_mask_zero():
    sampler, _ = log_probs()
    got = sampler_mismatch(sampler, sampler, MASK)
    assert all(float(value) == 0.0 for value in got.values())
    empty = sampler_mismatch(*log_probs(), np.zeros_like(MASK))
    assert all(float(value) == 0.0 for value in empty.values())


@pytest.mark.parametrize(
    "rule, lower_cap, capped",
    [
        ("tis", 0.0, [[0.25, 1.0, 2.0, 0.0], [1.5, 2.0, 0.0, 0.0]]),  # min(r, 2): no lower bound
        ("mis", 0.0, [[0.0, 1.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]]),  # r, or 0 outside [1/2, 2]
        ("mis", 0.2, [[0.25, 1.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]]),  # r, or 0 outside [0.2, 2]
    ],
)
def test_token_weights_are_truncated_at_the_cap_or_masked_outside_the_caps_and_zero_on_padding(rule, lower_cap, capped):
    ratios, weights = rollout_correction_weights(*log_probs(), MASK, rule, 2.0, "token", lower_cap)
    np.testing.assert_allclose(ratios, np.where(MASK, RATIOS, 0.0), rtol=1e-5)
    np.testing.assert_allclose(weights, capped, rtol=1e-5)


def test_a_ratio_exactly_at_either_cap_stays_in_the_loss():
    ratios, _ = rollout_correction_weights(*log_probs(), MASK, "mis", 2.0, "token")
    at_cap, at_lower = float(ratios[0, 2]), float(ratios[0, 0])  # 3 and 0.25 as float32 computes them
    _, weights = rollout_correction_weights(*log_probs(), MASK, "mis", at_cap, "token", at_lower)
    assert float(weights[0, 2]) == at_cap and float(weights[0, 0]) == at_lower


@pytest.mark.parametrize(
    "level, rho",
    [
        ("sequence", [0.75, 3.75]),  # the product: 0.25 * 1 * 3, 1.5 * 2.5 (verl's sequence level)
        ("geometric", [0.75 ** (1 / 3), 3.75**0.5]),  # its geometric mean
    ],
)
@pytest.mark.parametrize("rule", ["tis", "mis"])
def test_response_weights_are_the_product_or_geometric_mean_ratio_capped_for_all_its_tokens(rule, level, rho):
    ratios, weights = rollout_correction_weights(*log_probs(), MASK, rule, 1.5, level)
    expected = np.array([[rho[0]] * 3 + [0.0], [rho[1]] * 2 + [0.0] * 2])
    np.testing.assert_allclose(ratios, expected, rtol=1e-5)
    over_cap = 1.5 if rule == "tis" else 0.0  # response 1's, over the cap 1.5; response 0's within [1/1.5, 1.5]
    np.testing.assert_allclose(weights, [expected[0], [over_cap] * 2 + [0.0] * 2], rtol=1e-5)


def test_a_sequence_ratio_is_clipped_at_exp_20_not_overflowed():
    long_mask = np.ones((1, 64), bool)
    sampler = np.full((1, 64), np.log(0.1), np.float32)
    _, ratio_per_token_2 = log_probs(np.full((1, 64), 2.0), sampler)
    ratios, _ = rollout_correction_weights(sampler, ratio_per_token_2, long_mask, "tis", 2.0, "sequence")
    np.testing.assert_allclose(ratios, np.exp(20.0), rtol=1e-5)  # 2^64 past the clip


@pytest.mark.parametrize("rule", ["tis", "mis"])
def test_a_non_finite_ratio_stays_non_finite_in_its_weight_and_its_response_at_sequence_level(rule):
    sampler, score = log_probs()
    score[0, 1] = np.nan
    _, token = rollout_correction_weights(sampler, score, MASK, rule, 2.0, "token")
    assert np.isnan(token[0, 1]) and np.isfinite(np.delete(np.asarray(token), 1, axis=1)).all()
    _, sequence = rollout_correction_weights(sampler, score, MASK, rule, 2.0, "geometric")
    assert np.isnan(sequence[0, :3]).all() and np.isfinite(sequence[1]).all() and float(sequence[0, 3]) == 0.0
    assert np.isnan(float(sampler_mismatch(sampler, score, MASK)["kl"]))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(rule="truncate"), r"rule='truncate': expected one of \('tis', 'mis'\)"),
        (dict(level="response"), r"level='response': expected one of \('token', 'sequence', 'geometric'\)"),
        (dict(cap=1.0), r"cap=1\.0: must be > 1"),
        (dict(lower_cap=1.0), r"lower_cap=1\.0: must be in \[0, 1\)"),
    ],
)
def test_an_unknown_rule_or_level_or_a_cap_not_above_one_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        rollout_correction_weights(*log_probs(), MASK, **options)
