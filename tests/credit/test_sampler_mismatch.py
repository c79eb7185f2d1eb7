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
    "rule, capped",
    [
        ("tis", [[0.25, 1.0, 2.0, 0.0], [1.5, 2.0, 0.0, 0.0]]),  # min(r, 2)
        ("mis", [[0.25, 1.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]]),  # r, or 0 over 2
    ],
)
def test_token_weights_are_truncated_or_masked_at_the_cap_and_zero_on_padding(rule, capped):
    ratios, weights = rollout_correction_weights(*log_probs(), MASK, rule, 2.0, "token")
    np.testing.assert_allclose(ratios, np.where(MASK, RATIOS, 0.0), rtol=1e-5)
    np.testing.assert_allclose(weights, capped, rtol=1e-5)


@pytest.mark.parametrize("rule, over_cap", [("tis", 1.5), ("mis", 0.0)])
def test_sequence_weights_are_each_responses_geometric_mean_ratio_capped_for_all_its_tokens(rule, over_cap):
    ratios, weights = rollout_correction_weights(*log_probs(), MASK, rule, 1.5, "sequence")
    # rho_0 = (0.25 * 1 * 3)^(1/3) = 0.75^(1/3), under the cap; rho_1 = (1.5 * 2.5)^(1/2) = 3.75^(1/2), over it.
    rho = np.array([[0.75 ** (1 / 3)] * 3 + [0.0], [3.75**0.5] * 2 + [0.0] * 2])
    np.testing.assert_allclose(ratios, rho, rtol=1e-5)
    np.testing.assert_allclose(weights, [rho[0], [over_cap] * 2 + [0.0] * 2], rtol=1e-5)


@pytest.mark.parametrize("rule", ["tis", "mis"])
def test_a_non_finite_ratio_stays_non_finite_in_its_weight_and_its_response_at_sequence_level(rule):
    sampler, score = log_probs()
    score[0, 1] = np.nan
    _, token = rollout_correction_weights(sampler, score, MASK, rule, 2.0, "token")
    assert np.isnan(token[0, 1]) and np.isfinite(np.delete(np.asarray(token), 1, axis=1)).all()
    _, sequence = rollout_correction_weights(sampler, score, MASK, rule, 2.0, "sequence")
    assert np.isnan(sequence[0, :3]).all() and np.isfinite(sequence[1]).all() and float(sequence[0, 3]) == 0.0
    assert np.isnan(float(sampler_mismatch(sampler, score, MASK)["kl"]))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(rule="truncate"), r"rule='truncate': expected one of \('tis', 'mis'\)"),
        (dict(level="response"), r"level='response': expected one of \('token', 'sequence'\)"),
        (dict(cap=1.0), r"cap=1\.0: must be > 1"),
    ],
)
def test_an_unknown_rule_or_level_or_a_cap_not_above_one_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        rollout_correction_weights(*log_probs(), MASK, **options)
