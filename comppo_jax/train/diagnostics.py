"""Per-step diagnostics of the gate and the critic (host-side NumPy, over valid response tokens).

Gate: mean, median and interquartile range of kappa, its mean over the first / middle / last third of
each response (t / T_i), and its mean on correct versus incorrect responses.
Critic: explained variance of the returns G_t by V_t, the Spearman rank correlation of V_t with
its one-step TD target r_t + kappa_t V_{t+1} m_{t+1} (eq. comp_td), the mean absolute error
|V_t - G_t|, and the fraction of values saturated at the [-1, 1] clamp (eq. value_mix).
"""

from __future__ import annotations

import numpy as np

CLAMP_SATURATION = 0.99  # |V| at or above this fraction of the clamp counts as saturated


def gate_statistics(kappa, mask, correct) -> dict[str, float]:
    """kappa, mask [B, T]; correct [B] bool. Keys with no tokens behind them are left out."""
    kappa, mask, correct = np.asarray(kappa, np.float64), np.asarray(mask, bool), np.asarray(correct, bool)
    if not mask.any():
        return {}
    valid = kappa[mask]
    q25, q75 = np.percentile(valid, [25, 75])
    lengths = mask.sum(axis=1, keepdims=True)
    third = np.minimum((3 * np.arange(mask.shape[1])[None, :]) // np.maximum(lengths, 1), 2)
    out = {"gate/mean": float(valid.mean()), "gate/median": float(np.median(valid)), "gate/iqr": float(q75 - q25)}
    groups = {f"gate/{name}_third": mask & (third == i) for i, name in enumerate(("first", "middle", "last"))}
    groups.update({"gate/correct": mask & correct[:, None], "gate/incorrect": mask & ~correct[:, None]})
    out.update({name: float(kappa[where].mean()) for name, where in groups.items() if where.any()})
    return out


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x`, ties sharing the mean of the ranks they span."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)
    return (last - (counts - 1) / 2.0)[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (the Pearson correlation of the average ranks), as
    scipy.stats.spearmanr computes it; here in NumPy, since scipy.stats costs every launch a second to import."""
    return float(np.corrcoef(average_ranks(x), average_ranks(y))[0, 1])


def critic_diagnostics(values, returns, rewards, kappa, mask, clamp: float = 1.0) -> dict[str, float]:
    """values V_t, returns G_t, per-token rewards r_t, kappa [B, T] and the mask [B, T].

    Explained variance and the Spearman correlation are left out when undefined (constant
    returns, or constant values such as the zero-initialized critic's).
    """
    values, returns, rewards, kappa = (np.asarray(x, np.float64) for x in (values, returns, rewards, kappa))
    mask = np.asarray(mask, bool)
    if not mask.any():
        return {}
    next_values = np.concatenate([values[:, 1:] * mask[:, 1:], np.zeros_like(values[:, :1])], axis=1)
    td_target = rewards + kappa * next_values
    v, g, y = values[mask], returns[mask], td_target[mask]
    out = {
        "critic/value_mae": float(np.abs(v - g).mean()),
        "critic/clamp_saturation": float(np.mean(np.abs(v) >= CLAMP_SATURATION * clamp)),
    }
    if g.var() > 0:  # undefined (left out) when every return is equal
        out["critic/explained_variance"] = float(1.0 - (g - v).var() / g.var())
    if v.std() > 0 and y.std() > 0:
        out["critic/td_spearman"] = spearman(v, y)
    return out
