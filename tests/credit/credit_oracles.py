"""NumPy float64 oracles for the credit estimators, written independently of the code under test."""

from __future__ import annotations

import numpy as np


def comp_gae_loop(rewards, values, kappa, mask, lam):
    """DESIGN.md's Comp-GAE rules, literally, as a reversed Python loop (float64)."""
    r, v, k = (np.asarray(x, np.float64) for x in (rewards, values, kappa))
    m = np.asarray(mask).astype(bool)
    batch, length = r.shape
    adv = np.zeros((batch, length))
    ret = np.zeros((batch, length))
    for b in range(batch):
        a_next = v_next = m_next = 0.0
        for t in reversed(range(length)):
            if m[b, t]:
                delta = r[b, t] + k[b, t] * v_next * m_next - v[b, t]
                a = delta + lam * k[b, t] * a_next * m_next
                adv[b, t], ret[b, t] = a, a + v[b, t]
            else:
                a = 0.0
            a_next, v_next, m_next = a, (v[b, t] if m[b, t] else 0.0), float(m[b, t])
    return adv, ret


def td_residuals(rewards, values, kappa, mask):
    """delta_t of paper eq. (comp_td) with the mask rules, zero on padding (float64)."""
    m = np.asarray(mask).astype(bool)
    r, v, k = (np.where(m, np.asarray(x, np.float64), 0.0) for x in (rewards, values, kappa))
    v_next = np.pad(v[:, 1:], ((0, 0), (0, 1)))
    return np.where(m, r + k * v_next - v, 0.0)


def unrolled_advantages(delta, kappa, lengths, lam):
    """Paper eq. (unrolled) for right-padded rows: A_t = sum_{u>=t} lam^(u-t) prod_{j=t}^{u-1} kappa_j delta_u."""
    delta, kappa = np.asarray(delta, np.float64), np.asarray(kappa, np.float64)
    adv = np.zeros_like(delta)
    for b, length in enumerate(lengths):
        for t in range(length):
            total = 0.0
            for u in range(t, length):
                total += lam ** (u - t) * np.prod(kappa[b, t:u]) * delta[b, u]
            adv[b, t] = total
    return adv


def ppo_trainer_gae(rewards, values, mask, gamma, lam):
    """NumPy port of the masked GAE loop of PPO trainers on right-padded batches
    (TRL's PPOTrainer, verl's compute_gae_advantage_return before multi-turn masks):
    values and rewards are zeroed on padding, then the reversed lastgaelam loop runs
    over the full width; advantages are zeroed on padding afterwards."""
    m = np.asarray(mask, np.float64)
    values = np.asarray(values, np.float64) * m
    rewards = np.asarray(rewards, np.float64) * m
    length = rewards.shape[1]
    lastgaelam = np.zeros(rewards.shape[0])
    advantages_reversed = []
    for t in reversed(range(length)):
        nextvalues = values[:, t + 1] * m[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = np.stack(advantages_reversed[::-1], axis=1) * m
    returns = (advantages + values) * m
    return advantages, returns


def masked_whiten(values, mask, eps=1e-8):
    """Port of verl/TRL `masked_whiten` (shift_mean=True, unbiased variance)."""
    m = np.asarray(mask, np.float64)
    x = np.asarray(values, np.float64)
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / n * n / (n - 1)
    return (x - mean) / np.sqrt(var + eps) * m


def grpo(rewards, group_size, eps=1e-6):
    """(R - mean) / (std + eps) per group, unbiased std; tied groups get 0 (float64, [B])."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    out = np.zeros_like(r)
    for g, row in enumerate(r):
        if np.ptp(row) > 0:
            out[g] = (row - row.mean()) / (row.std(ddof=1) + eps)
    return out.reshape(-1)
