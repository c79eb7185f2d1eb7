"""Credit across the environment's spans: by hand on one conversation, through `registry.estimate` (the
learner's path), for both crossings; the environment's tokens get nothing and change nothing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from comppo_jax.credit import turns
from comppo_jax.credit.registry import EstimatorSpec, Statistics, estimate

# p1 p2(call) e1 e2 p3 p4 pad: reward 1 at p4
ENV = jnp.asarray([[0, 0, 1, 1, 0, 0, 0]], bool)
MASK = jnp.asarray([[1, 1, 0, 0, 1, 1, 0]], bool)  # the policy's tokens
REWARD_TOKENS = jnp.asarray([[0, 0, 0, 0, 0, 1.0, 0]])
VALUES = jnp.asarray([[0.1, 0.2, 0.9, 0.9, 0.3, 0.4, 0.0]])
KAPPA = jnp.asarray([[0.5, 0.6, 0.7, 0.7, 0.8, 0.9, 0.0]])
TOKENS = jnp.asarray([[5, 6, 7, 8, 9, 10, 0]])
LAM = 0.95


def by_hand(call_kappa: float) -> np.ndarray:
    """Comp-GAE over p1 p2 p3 p4, p2's kappa (the crossing) `call_kappa`; returns G_t = A_t + V_t there."""
    v, k = [0.1, 0.2, 0.3, 0.4], [0.5, call_kappa, 0.8, 0.9]
    r = [0, 0, 0, 1.0]
    advantages, following_value, following_advantage = [0.0] * 4, 0.0, 0.0
    for t in reversed(range(4)):
        delta = r[t] + k[t] * following_value - v[t]
        advantages[t] = delta + LAM * k[t] * following_advantage
        following_value, following_advantage = v[t], advantages[t]
    g = np.asarray(advantages) + v
    return np.asarray([g[0], g[1], 0, 0, g[2], g[3], 0])


def credit(name: str, crossing: str, values=VALUES, kappa=KAPPA, reward_tokens=REWARD_TOKENS):
    spec = EstimatorSpec(name, lam=LAM, group=1, env_crossing=crossing)
    return estimate(spec, jnp.asarray([1.0]), reward_tokens, TOKENS, values, kappa, MASK, Statistics(env_mask=ENV))


@pytest.mark.parametrize("crossing,call_kappa", [("transition", 0.6), ("pass", 1.0)])
def test_comp_gae_crosses_the_span_as_its_convention_says(crossing, call_kappa):
    advantages, returns = credit("comp_gae", crossing)
    np.testing.assert_allclose(returns, by_hand(call_kappa)[None], atol=1e-6)
    assert (np.asarray(advantages)[~np.asarray(MASK)] == 0).all()


@pytest.mark.parametrize("name", ["comp_gae", "gae", "grpo"])
@pytest.mark.parametrize("crossing", turns.CROSSINGS)
def test_the_environments_tokens_get_nothing_and_change_nothing(name, crossing):
    advantages, returns = credit(name, crossing)
    env = np.asarray(ENV)
    assert (np.asarray(advantages)[env] == 0).all() and (np.asarray(returns)[env] == 0).all()
    noise = jnp.where(ENV, 7.0, 0.0)
    other = credit(name, crossing, values=VALUES + noise, kappa=KAPPA + noise, reward_tokens=REWARD_TOKENS + noise)
    np.testing.assert_allclose(other[0], advantages, atol=1e-6)
    np.testing.assert_allclose(other[1], returns, atol=1e-6)


def test_gae_with_gamma_one_is_the_same_under_both_crossings():
    np.testing.assert_allclose(credit("gae", "pass")[1], credit("gae", "transition")[1], atol=1e-6)


def test_grpo_broadcasts_over_the_policys_tokens_only():
    advantages, _ = credit("grpo", "pass")
    assert len(set(np.asarray(advantages)[np.asarray(MASK)].tolist())) == 1


def test_compact_and_expand_are_inverse_and_keep_the_policys_order():
    order = turns.policy_order(ENV)
    compacted = turns.compact(TOKENS, order)
    assert compacted[0, :4].tolist() == [5, 6, 9, 10]
    np.testing.assert_array_equal(turns.expand(compacted, order), TOKENS)
    assert turns.call_tokens(ENV, MASK).tolist() == [[False, True, False, False, False, False, False]]


def test_an_unknown_crossing_is_refused_by_name():
    with pytest.raises(ValueError, match="env_crossing"):
        credit("comp_gae", "teleport")
