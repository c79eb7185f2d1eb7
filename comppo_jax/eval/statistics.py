"""The paper's statistics (section 6 and appendix B): curve endpoints, Student-t intervals,
seed-matched differences, the factorial interaction and the PPO stress-grid stability rule.

Accuracies are fractions in [0, 1] (the paper prints points = 100 x fraction). A learning curve is
(steps, accuracies) at the run's dev evaluations, in step order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scipy import stats


class Interval(NamedTuple):
    """mean and a two-sided interval [low, high] over n values."""

    mean: float
    low: float
    high: float
    n: int


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Two-sided Student-t interval: mean +- t_{(1+confidence)/2, n-1} * s / sqrt(n), s with ddof=1.

    One value gives a degenerate interval [mean, mean]; no values is an error.
    """
    values = np.asarray(values, np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"t_interval needs a non-empty 1-D sequence, got shape {values.shape}")
    mean = float(values.mean())
    if values.size == 1:
        return Interval(mean, mean, mean, 1)
    half = float(stats.t.ppf(0.5 + confidence / 2, values.size - 1) * values.std(ddof=1) / np.sqrt(values.size))
    return Interval(mean, mean - half, mean + half, int(values.size))


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Interval:
    """Seed-matched difference a - b (a[i] and b[i] share seed i), with its t interval."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_difference needs seed-matched runs of equal count, got {a.shape} and {b.shape}")
    return t_interval(a - b, confidence)


def factorial_interaction(full, gate_standard, fixed_aligned, fixed_standard, confidence: float = 0.95) -> Interval:
    """Seed-matched gate-by-critic interaction (paper eq. interaction):

        I = Full - (Gate + Std) - (Fixed + Aligned) + (Fixed + Std),

    per seed, with its t interval. Each argument holds one value per seed, in the same seed order.
    """
    cells = [np.asarray(x, np.float64) for x in (full, gate_standard, fixed_aligned, fixed_standard)]
    if len({c.shape for c in cells}) != 1:
        raise ValueError(f"the four factorial cells need the same seeds, got shapes {[c.shape for c in cells]}")
    full, gate_standard, fixed_aligned, fixed_standard = cells
    return t_interval(full - gate_standard - fixed_aligned + fixed_standard, confidence)


def _curve(steps, accuracies):
    steps, accuracies = np.asarray(steps, np.float64), np.asarray(accuracies, np.float64)
    if steps.shape != accuracies.shape or steps.ndim != 1 or steps.size == 0:
        raise ValueError(
            f"a curve needs equal-length 1-D steps and accuracies, got {steps.shape} and {accuracies.shape}"
        )
    if np.any(np.diff(steps) <= 0):
        raise ValueError("curve steps must be strictly increasing")
    return steps, accuracies


def aulc(steps, accuracies) -> float:
    """Area under the learning curve (trapezoids over the evaluated steps) / the observed step range.

    A single evaluation has no range; its accuracy is returned.
    """
    steps, accuracies = _curve(steps, accuracies)
    if steps.size == 1:
        return float(accuracies[0])
    area = float(np.sum((accuracies[1:] + accuracies[:-1]) / 2 * np.diff(steps)))
    return area / float(steps[-1] - steps[0])


def step_to(steps, accuracies, target: float) -> float | None:
    """The first evaluated step whose accuracy reaches `target`, or None if none does."""
    steps, accuracies = _curve(steps, accuracies)
    reached = np.nonzero(accuracies >= target)[0]
    return float(steps[reached[0]]) if reached.size else None


def curve_endpoints(steps, accuracies, *, last: int = 20, target: float | None = None) -> dict[str, float | None]:
    """Best, Final (primary), Last-20 (mean of the final `last` evaluations), AULC, the
    peak-to-final drop (best - final) and, with a target, the step to reach it (paper section 6)."""
    steps, accuracies = _curve(steps, accuracies)
    out = {
        "best": float(accuracies.max()),
        "final": float(accuracies[-1]),
        f"last_{last}": float(accuracies[-last:].mean()),
        "aulc": aulc(steps, accuracies),
        "peak_to_final_drop": float(accuracies.max() - accuracies[-1]),
    }
    if target is not None:
        out["step_to_target"] = step_to(steps, accuracies, target)
    return out


def is_stable(accuracies, base: float, *, max_drop: float = 0.15, run_below: int = 5) -> bool:
    """The PPO stress-grid stability rule (paper section 6.5): final >= base, peak-to-final drop
    < max_drop, and no `run_below` consecutive checkpoints after the peak below base.

    The peak is the first maximum; "after the peak" excludes the peak itself.
    """
    accuracies = np.asarray(accuracies, np.float64)
    if accuracies.ndim != 1 or accuracies.size == 0:
        raise ValueError(f"is_stable needs a non-empty 1-D accuracy curve, got shape {accuracies.shape}")
    final, peak_index = accuracies[-1], int(np.argmax(accuracies))
    if final < base or accuracies[peak_index] - final >= max_drop:
        return False
    run = 0
    for value in accuracies[peak_index + 1 :]:
        run = run + 1 if value < base else 0
        if run >= run_below:
            return False
    return True
