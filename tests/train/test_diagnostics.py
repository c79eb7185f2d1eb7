"""Gate and critic diagnostics against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from comppo_jax.train.diagnostics import critic_diagnostics, gate_statistics, spearman


def test_gate_statistics_by_position_third_and_correctness():
    kappa = np.array([[0.1, 0.2, 0.3, 0.9, 0.9, 0.9], [0.5, 0.7, 0.6, 0.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], bool)
    stats = gate_statistics(kappa, mask, correct=[True, False])
    valid = [0.1, 0.2, 0.3, 0.9, 0.9, 0.9, 0.5, 0.7, 0.6]
    assert stats["gate/mean"] == pytest.approx(np.mean(valid))
    assert stats["gate/median"] == pytest.approx(0.6)
    assert stats["gate/iqr"] == pytest.approx(np.percentile(valid, 75) - np.percentile(valid, 25))
    # row 0 (T=6): thirds {0.1, 0.2}, {0.3, 0.9}, {0.9, 0.9}; row 1 (T=3): one token per third
    assert stats["gate/first_third"] == pytest.approx((0.1 + 0.2 + 0.5) / 3)
    assert stats["gate/middle_third"] == pytest.approx((0.3 + 0.9 + 0.7) / 3)
    assert stats["gate/last_third"] == pytest.approx((0.9 + 0.9 + 0.6) / 3)
    assert stats["gate/correct"] == pytest.approx(np.mean(kappa[0])) and stats["gate/incorrect"] == pytest.approx(0.6)
    assert "gate/incorrect" not in gate_statistics(kappa, mask, correct=[True, True])
    assert gate_statistics(kappa, np.zeros_like(mask), correct=[True, False]) == {}


def test_critic_diagnostics():
    mask = np.array([[1, 1, 1, 0]], bool)
    values = np.array([[0.2, 0.5, 1.0, 0.0]])
    returns = np.array([[0.4, 0.5, 0.7, 0.0]])
    rewards = np.array([[0.0, 0.0, 1.0, 0.0]])
    kappa = np.array([[0.5, 0.5, 0.5, 0.0]])
    stats = critic_diagnostics(values, returns, rewards, kappa, mask)
    v, g = values[0, :3], returns[0, :3]
    assert stats["critic/explained_variance"] == pytest.approx(1 - np.var(g - v) / np.var(g))
    assert stats["critic/value_mae"] == pytest.approx(np.mean(np.abs(v - g)))
    assert stats["critic/clamp_saturation"] == pytest.approx(1 / 3)  # |1.0| >= 0.99
    # TD targets r + kappa V' (V' = 0 past the end): 0.25, 0.5, 1.0 rank like V: Spearman 1
    assert stats["critic/td_spearman"] == pytest.approx(1.0)
    constant = critic_diagnostics(np.zeros((1, 4)), returns, rewards, kappa, mask)
    assert "critic/td_spearman" not in constant and "critic/explained_variance" in constant


def test_spearman_with_ties_is_scipys():
    from scipy import stats

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, 200).astype(float), rng.normal(size=200)  # x: many ties
    y[::3] = 0.5
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert spearman(x, -x) == pytest.approx(-1.0)
