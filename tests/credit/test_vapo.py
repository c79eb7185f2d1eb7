"""VAPO's credit (Yue et al. 2025, arXiv 2504.05118): the length-adaptive lambda, GAE with one lambda per
row, and the decoupled estimator (`registry.vapo_credit`) against NumPy loops of the paper's formulas."""

from __future__ import annotations

import credit_oracles as oracle
import numpy as np
import pytest

from comppo_jax.credit import gae, vapo_lambda
from comppo_jax.credit.registry import EstimatorSpec, estimate

METHODS = ("scan", "associative")


def hand_lambda(lengths, alpha):
    """lambda_policy = 1 - 1 / (alpha l), clipped to [0, 1] (alpha l < 1, l = 0 included: 0)."""
    out = []
    for length in lengths:
        out.append(0.0 if alpha * length < 1 else 1.0 - 1.0 / (alpha * length))
    return np.asarray(out)


def batch(lengths=(2, 5, 8, 6, 1, 3), width=8, seed=0):
    """(terminal-reward tokens, values with garbage on padding, right-padded mask) [B, T] float32."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    mask = np.arange(width)[None] < lengths[:, None]
    rewards = np.zeros(mask.shape, np.float32)
    rewards[np.arange(len(lengths)), lengths - 1] = rng.integers(0, 2, len(lengths))
    values = np.where(mask, rng.uniform(-1, 1, mask.shape), 99.0).astype(np.float32)
    return rewards, values, mask


def test_vapo_lambda_is_one_minus_one_over_alpha_l_clipped_to_the_unit_interval():
    lengths = np.array([0, 1, 10, 19, 20, 21, 40, 400, 16000])
    for alpha in (0.05, 0.25, 1.0):
        got = vapo_lambda(lengths, alpha)
        np.testing.assert_allclose(got, hand_lambda(lengths, alpha), rtol=1e-6, atol=1e-7)
        assert got.shape == lengths.shape and got.dtype == np.float32
    # VAPO's alpha = 0.05: 20 tokens is the first length with a positive lambda, 40 gives 1/2, 16k tokens ~0.9987.
    np.testing.assert_allclose(vapo_lambda(np.array([20, 40, 16000]), 0.05), [0.0, 0.5, 1 - 1 / 800], rtol=1e-6)
    np.testing.assert_array_equal(vapo_lambda(np.array([3.0, 4.0]), 0.25), [0.0, 0.0])  # float lengths too
    for alpha in (0.0, -0.05):
        with pytest.raises(ValueError, match="alpha must be > 0"):
            vapo_lambda(lengths, alpha)
    with pytest.raises(ValueError, match=r"lengths must have shape \[B\]"):
        vapo_lambda(lengths[None], 0.05)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_with_a_lambda_per_row_matches_the_loop(method, gamma):
    rewards, values, mask = batch()
    rewards = rewards + np.where(mask, 0.1, 0.0).astype(np.float32)  # dense rewards too
    lams = np.array([0.0, 0.2, 0.5, 1.0, 0.95, 1 / 3], np.float32)
    # The PPO trainers' GAE loop, A_t = delta_t + gamma lam A_{t+1}, with its [B] carry times a [B] lambda.
    want_adv, want_ret = oracle.ppo_trainer_gae(rewards, values, mask, gamma, lams.astype(np.float64))
    for lam in (lams, lams[:, None]):
        adv, ret = gae(rewards, values, mask, gamma, lam, method=method)
        np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-6)
    # The same lambda on every row is the scalar lambda's GAE, bit for bit.
    for got, want in zip(
        gae(rewards, values, mask, gamma, np.full(6, 0.7, np.float32), method=method),
        gae(rewards, values, mask, gamma, 0.7, method=method),
    ):
        np.testing.assert_array_equal(got, want)


def test_gae_rejects_a_lambda_of_another_shape():
    rewards, values, mask = batch()
    for shape in ((5,), (6, 2), (1, 6)):
        with pytest.raises(ValueError, match=r"lam must be a float, \[B\] or \[B, 1\] with B = 6"):
            gae(rewards, values, mask, 1.0, np.full(shape, 0.5, np.float32))


@pytest.mark.parametrize("critic_lam", [1.0, 0.8])
def test_vapo_credit_decouples_the_policy_s_length_adaptive_gae_from_the_critic_s(critic_lam):
    """Advantages: per-row lambda_policy = 1 - 1 / (alpha l) GAE at gamma = 1, whitened over the batch's tokens;
    returns (the critic's targets): lambda_critic GAE, at 1 the Monte-Carlo return sum_{u >= t} r_u."""
    rewards, values, mask = batch()
    spec = EstimatorSpec("vapo", lam=0.95, vapo_alpha=0.25, vapo_critic_lam=critic_lam)
    adv, ret = estimate(spec, rewards.sum(1), rewards, None, values, None, mask)  # ESTIMATORS["vapo"]
    lams = hand_lambda(mask.sum(1), 0.25)
    np.testing.assert_allclose(lams, [0.0, 0.2, 0.5, 1 / 3, 0.0, 0.0], atol=1e-12)
    policy_adv, _ = oracle.ppo_trainer_gae(rewards, values, mask, 1.0, lams)
    _, critic_ret = oracle.ppo_trainer_gae(rewards, values, mask, 1.0, critic_lam)
    np.testing.assert_allclose(adv, oracle.masked_whiten(policy_adv, mask), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, critic_ret, rtol=1e-5, atol=1e-6)
    if critic_lam == 1.0:  # Monte-Carlo: the reward still to come, whatever the values
        to_go = np.where(mask, np.flip(np.cumsum(np.flip(np.where(mask, rewards, 0.0), 1), 1), 1), 0.0)
        np.testing.assert_allclose(ret, to_go, atol=1e-6)
