"""PPO clipped surrogate, reference KL, clipped value loss, entropy and the token-mean."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from comppo_jax.credit import entropy_from_logits, kl_penalty, masked_mean, ppo_clip_loss, value_loss

SHAPE = (3, 8)


def arrays(lo, hi):
    return hnp.arrays(np.float32, SHAPE, elements=st.floats(lo, hi, width=32))


masks = hnp.arrays(np.bool_, SHAPE).filter(lambda m: m.any())


def token_mean(x, mask):
    return np.asarray(x, np.float64)[mask].mean()


@settings(max_examples=50, deadline=None)
@given(logp=arrays(-5, 0), old=arrays(-5, 0), adv=arrays(-3, 3), mask=masks,
       clip=st.sampled_from(((0.2, 0.2), (0.2, 0.28), (0.1, 0.3))))
def test_ppo_clip_loss_matches_formula(logp, old, adv, mask, clip):
    lo, hi = clip
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, lo, hi)
    ratio = np.exp(logp.astype(np.float64) - old)
    unclipped, clipped = -adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi)
    assert float(loss) == pytest.approx(token_mean(np.maximum(unclipped, clipped), mask), rel=1e-4, abs=1e-5)
    assert float(metrics["approx_kl"]) == pytest.approx(token_mean(old - logp.astype(np.float64), mask), rel=1e-4, abs=1e-5)
    # Clip fraction counts tokens where the clipped branch is strictly active (float noise aside).
    active = (clipped > unclipped + 1e-5)[mask].mean()
    maybe = (clipped > unclipped - 1e-5)[mask].mean()
    assert active - 1e-6 <= float(metrics["clip_fraction"]) <= maybe + 1e-6


def test_ppo_gradient_vanishes_exactly_where_clipped_and_padding_is_ignored():
    mask = np.array([[1, 1, 1, 1, 1, 0]], bool)
    old = np.zeros((1, 6), np.float32)
    adv = np.array([[1.0, 1.0, -1.0, -1.0, 1.0, np.nan]], np.float32)
    # ratios 1.5 (A>0: clipped), 0.5 (A>0: not clipped), 1.5 (A<0: not clipped), 0.5 (A<0: clipped),
    # 1.0 (inside the clip range: both branches equal, not counted as clipped); padding is nan.
    logp = np.log(np.array([[1.5, 0.5, 1.5, 0.5, 1.0, np.nan]], np.float32))
    (loss, metrics), grad = jax.value_and_grad(ppo_clip_loss, has_aux=True)(logp, old, adv, mask)
    np.testing.assert_allclose(grad[0], [0.0, -0.5 / 5, 1.5 / 5, 0.0, -1.0 / 5, 0.0], rtol=1e-6)
    assert float(metrics["clip_fraction"]) == pytest.approx(0.4)
    assert np.isfinite(float(loss))
    # Wild log-ratios stay finite (exp is bounded by the +-20 clamp).
    far = ppo_clip_loss(np.full((1, 6), 100.0, np.float32), old, np.zeros((1, 6), np.float32), mask)[0]
    assert np.isfinite(float(far))


@settings(max_examples=50, deadline=None)
@given(logp=arrays(-30, 0), ref=arrays(-30, 0), mask=masks)
# Where exp(d) - d - 1 rounds to -6e-8 in float32 (found by hypothesis).
@example(logp=np.full((3, 8), -5.9604645e-08, np.float32), ref=np.zeros((3, 8), np.float32), mask=np.ones((3, 8), bool))
def test_kl_estimators_match_verl(logp, ref, mask):
    k1 = kl_penalty(logp, ref, mask, kind="k1")
    assert float(k1) == pytest.approx(token_mean(logp.astype(np.float64) - ref, mask), rel=1e-4, abs=1e-4)
    d = np.clip(ref.astype(np.float64) - logp, -20, 20)
    want = token_mean(np.clip(np.exp(d) - d - 1, -10, 10), mask)
    for kind in ("low_var_kl", "k3"):
        got = float(kl_penalty(logp, ref, mask, kind=kind))
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
        assert 0.0 <= got <= 10.0


def test_kl_gradient_flows_to_the_policy_only():
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.0]])
    mask = np.ones((1, 2), bool)
    g_logp, g_ref = jax.grad(lambda a, b: kl_penalty(a, b, mask), argnums=(0, 1))(logp, ref)
    # d/dlogp of exp(ref - logp) - (ref - logp) - 1 = 1 - exp(ref - logp), averaged over 2 tokens.
    np.testing.assert_allclose(g_logp, (1 - np.exp(ref - logp)) / 2, rtol=1e-6)
    np.testing.assert_array_equal(g_ref, 0.0)
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_penalty(logp, ref, mask, kind="k2")


@settings(max_examples=50, deadline=None)
@given(v=arrays(-1, 1), old=arrays(-1, 1), ret=arrays(-2, 2), mask=masks, clip=st.sampled_from((0.2, 0.5)))
def test_value_loss_matches_formula(v, old, ret, mask, clip):
    loss, metrics = value_loss(v, old, ret, mask, clip)
    v64, old64 = v.astype(np.float64), old.astype(np.float64)
    v_clip = old64 + np.clip(v64 - old64, -clip, clip)
    unclipped, clipped = (v64 - ret) ** 2, (v_clip - ret) ** 2
    assert float(loss) == pytest.approx(0.5 * token_mean(np.maximum(unclipped, clipped), mask), rel=1e-4, abs=1e-6)
    active = (clipped > unclipped + 1e-5)[mask].mean()
    maybe = (clipped > unclipped - 1e-5)[mask].mean()
    assert active - 1e-6 <= float(metrics["clip_fraction"]) <= maybe + 1e-6


def test_value_loss_gradient_only_reaches_current_values():
    v, old, ret = jnp.array([[0.9, 0.1]]), jnp.array([[0.0, 0.0]]), jnp.array([[1.0, -1.0]])
    mask = np.ones((1, 2), bool)
    grads = jax.grad(lambda a, b, c: value_loss(a, b, c, mask, 0.5)[0], argnums=(0, 1, 2))(v, old, ret)
    # Token 0: v moved 0.9 > clip, clipped error (0.5 - 1)^2 > (0.9 - 1)^2, so the clipped branch
    # (constant in v) is active: zero gradient. Token 1: unclipped, 0.5 * 2 * (0.1 + 1) / 2 tokens.
    np.testing.assert_allclose(grads[0], [[0.0, 0.55]], rtol=1e-6)
    np.testing.assert_array_equal(grads[1], 0.0)
    np.testing.assert_array_equal(grads[2], 0.0)


@settings(max_examples=30, deadline=None)
@given(logits=hnp.arrays(np.float32, (2, 3, 11), elements=st.floats(-20, 20, width=32)))
def test_entropy_matches_numpy(logits):
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -(p * np.log(np.maximum(p, 1e-300))).sum(-1)
    np.testing.assert_allclose(entropy_from_logits(logits), want, atol=1e-4)


def test_entropy_extremes_and_masked_vocabulary():
    uniform = np.zeros((1, 2, 7), np.float32)
    np.testing.assert_allclose(entropy_from_logits(uniform), np.log(7), rtol=1e-6)
    masked = np.array([[[0.0, 0.0, -np.inf, -np.inf]]], np.float32)
    np.testing.assert_allclose(entropy_from_logits(masked), [[np.log(2)]], rtol=1e-6)
    grad = jax.grad(lambda z: entropy_from_logits(z).sum())(jnp.asarray(masked))
    assert np.all(np.isfinite(grad))
    with pytest.raises(ValueError, match=r"logits must have shape \[B, T, V\], got shape \(2, 7\)"):
        entropy_from_logits(np.zeros((2, 7), np.float32))


def test_token_mean_aggregation():
    x = np.array([[1.0, 2.0, np.inf], [3.0, np.nan, np.nan]], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    # Mean over the 3 valid tokens of the batch, not a mean of per-row means ((1.5 + 3) / 2).
    assert float(masked_mean(x, mask)) == pytest.approx(2.0)
    assert float(masked_mean(x, np.zeros_like(mask))) == 0.0
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 2\) but log_probs has shape \(2, 3\)"):
        ppo_clip_loss(x, x, x[:, :2], mask)
    with pytest.raises(ValueError, match=r"returns has shape \(1, 3\) but values has shape \(2, 3\)"):
        value_loss(x, x, x[:1], mask)
