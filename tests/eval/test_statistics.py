"""The paper's statistics against hand-computed values."""

from __future__ import annotations

import pytest

from comppo_jax.eval.statistics import (
    aulc,
    curve_endpoints,
    factorial_interaction,
    is_stable,
    paired_difference,
    step_to,
    t_interval,
)

T_975 = {1: 12.706205, 2: 4.302653, 4: 2.776445}  # Student-t quantiles by degrees of freedom (tables)


def test_t_interval_of_one_to_five():
    # mean 3, s = sqrt(2.5), s / sqrt(5) = sqrt(0.5); half width t_{0.975, 4} * sqrt(0.5)
    interval = t_interval([1, 2, 3, 4, 5])
    half = T_975[4] * 0.5**0.5
    assert interval.mean == 3 and interval.n == 5
    assert interval.low == pytest.approx(3 - half, abs=1e-5) and interval.high == pytest.approx(3 + half, abs=1e-5)
    assert t_interval([0.7]) == (0.7, 0.7, 0.7, 1)
    with pytest.raises(ValueError, match="non-empty"):
        t_interval([])


def test_paired_difference_is_seed_matched():
    # differences 2, 3, 4: mean 3, s = 1, half width t_{0.975, 2} / sqrt(3)
    interval = paired_difference([3, 4, 5], [1, 1, 1])
    assert interval.mean == 3 and interval.high - 3 == pytest.approx(T_975[2] / 3**0.5, abs=1e-5)
    with pytest.raises(ValueError, match="seed-matched"):
        paired_difference([1, 2], [1])


def test_factorial_interaction():
    # seed 1: 0.60 - 0.55 - 0.56 + 0.54 = 0.03; seed 2: 0.62 - 0.56 - 0.57 + 0.55 = 0.04
    interval = factorial_interaction([0.60, 0.62], [0.55, 0.56], [0.56, 0.57], [0.54, 0.55])
    assert interval.mean == pytest.approx(0.035)
    assert interval.high - interval.mean == pytest.approx(
        T_975[1] * 0.005, abs=1e-6
    )  # s = 0.00707, s / sqrt(2) = 0.005
    with pytest.raises(ValueError, match="same seeds"):
        factorial_interaction([0.6], [0.5, 0.5], [0.5], [0.5])


def test_aulc_and_endpoints():
    steps, accuracies = [0, 10, 20, 30], [0.2, 0.4, 0.4, 0.3]
    assert aulc(steps[:3], accuracies[:3]) == pytest.approx((0.3 * 10 + 0.4 * 10) / 20)
    assert aulc([5], [0.4]) == 0.4
    endpoints = curve_endpoints(steps, accuracies, last=2, target=0.35)
    assert endpoints == pytest.approx(
        {
            "best": 0.4,
            "final": 0.3,
            "last_2": 0.35,
            "aulc": (3 + 4 + 3.5) / 30,
            "peak_to_final_drop": 0.1,
            "step_to_target": 10.0,
        }
    )
    assert step_to(steps, accuracies, 0.9) is None
    with pytest.raises(ValueError, match="strictly increasing"):
        aulc([0, 0], [0.1, 0.2])


@pytest.mark.parametrize(
    "curve, stable",
    [
        ([0.40, 0.50, 0.45, 0.44], True),
        ([0.40, 0.70, 0.50], False),  # peak-to-final drop 0.20 >= 0.15
        ([0.45, 0.50, 0.42], False),  # final below base
        ([0.50, 0.55, 0.40, 0.40, 0.40, 0.40, 0.40, 0.50], False),  # five consecutive post-peak checkpoints below base
        ([0.50, 0.55, 0.40, 0.40, 0.40, 0.40, 0.50, 0.50], True),  # four are allowed
    ],
)
def test_stability_rule(curve, stable):
    assert is_stable(curve, base=0.424) is stable
