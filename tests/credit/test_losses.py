"""PPO and GSPO clipped surrogates, loss aggregation, reference KL, clipped value loss, entropy."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from comppo_jax.credit import (
    IMPORTANCE_WEIGHT_RULES,
    aggregate_loss,
    decoupled_ppo_inputs,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    masked_mean,
    ppo_clip_loss,
    value_loss,
)

SHAPE = (3, 8)
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def arrays(lo, hi):
    return hnp.arrays(np.float32, SHAPE, elements=st.floats(lo, hi, width=32))


masks = hnp.arrays(np.bool_, SHAPE).filter(lambda m: m.any())


def token_mean(x, mask):
    return np.asarray(x, np.float64)[mask].mean()


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    """NumPy transcription of verl core_algos.agg_loss (dp_size=1, no global-batch overrides)."""
    loss_mat, loss_mask = np.asarray(loss_mat, np.float64), np.asarray(loss_mask, np.float64)
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = (loss_mat * loss_mask).sum(-1)
        seq_mask = (loss_mask.sum(-1) > 0).astype(np.float64)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = loss_mask.sum(-1)
        seq_losses = (loss_mat * loss_mask).sum(-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).astype(np.float64)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    assert loss_agg_mode == "seq-mean-token-sum-norm"
    if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
    return (loss_mat * loss_mask).sum(-1).sum() / loss_scale_factor


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """NumPy transcription of verl core_algos.compute_policy_loss_gspo (forward pass): the loss,
    pg_clipfrac, ppo_kl, and the per-token ratio s_i it uses (the value of sg(s_i) pi / sg(pi))."""
    old_log_prob, log_prob, advantages = (np.asarray(x, np.float64) for x in (old_log_prob, log_prob, advantages))
    response_mask = np.asarray(response_mask, np.float64)
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = np.maximum(response_mask.sum(-1), 1)
    negative_approx_kl_seq = (negative_approx_kl * response_mask).sum(-1) / seq_lengths
    log_seq_importance_ratio = np.minimum(negative_approx_kl_seq[:, None] + 0 * log_prob, 10.0)
    seq_importance_ratio = np.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * np.clip(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = np.maximum(pg_losses1, pg_losses2)
    pg_loss = verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    pg_clipfrac = ((pg_losses2 > pg_losses1) * response_mask).sum() / response_mask.sum()
    ppo_kl = (-negative_approx_kl * response_mask).sum() / response_mask.sum()
    return pg_loss, pg_clipfrac, ppo_kl, seq_importance_ratio


@settings(max_examples=50, deadline=None)
@given(
    logp=arrays(-5, 0),
    old=arrays(-5, 0),
    adv=arrays(-3, 3),
    mask=masks,
    clip=st.sampled_from(((0.2, 0.2), (0.2, 0.28), (0.1, 0.3))),
)
def test_ppo_clip_loss_matches_formula(logp, old, adv, mask, clip):
    lo, hi = clip
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, lo, hi)
    ratio = np.exp(logp.astype(np.float64) - old)
    unclipped, clipped = -adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi)
    assert float(loss) == pytest.approx(token_mean(np.maximum(unclipped, clipped), mask), rel=1e-4, abs=1e-5)
    assert float(metrics["approx_kl"]) == pytest.approx(
        token_mean(old - logp.astype(np.float64), mask), rel=1e-4, abs=1e-5
    )
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


def test_kl_follows_the_aggregation_it_is_given():
    """train.kl_aggregation=policy: the KL is reduced as the policy loss is (verl's convention)."""
    logp = np.array([[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0]], np.float32)
    ref = np.array([[-1.5, -1.0, -0.5], [-2.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
    d = np.clip(ref.astype(np.float64) - logp, -20, 20)
    per_token = np.where(mask, np.exp(d) - d - 1, 0.0)
    rows = per_token.sum(1)
    want = {
        "token-mean": rows.sum() / 4,
        "seq-mean-token-mean": (rows[0] / 3 + rows[1]) / 2,
        "seq-mean-token-sum-norm": rows.sum() / 8,
        "seq-mean-token-scale": rows.mean() / 8,
    }
    for mode, value in want.items():
        assert float(kl_penalty(logp, ref, mask, aggregation=mode, norm_length=8)) == pytest.approx(value, rel=1e-5), (
            mode
        )
    assert float(kl_penalty(logp, ref, mask)) == pytest.approx(want["token-mean"], rel=1e-5)


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


def test_aggregation_modes_by_hand():
    # Row 0: 3 valid tokens; row 1: 1 valid token and garbage; row 2: empty (excluded from the row counts).
    x = np.array([[1.0, 2.0, 3.0], [4.0, np.nan, np.inf], [np.nan, np.nan, np.nan]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    want = {
        "token-mean": (10 / 4, [[1 / 4] * 3, [1 / 4, 0, 0]]),
        "seq-mean-token-mean": ((6 / 3 + 4) / 2, [[1 / 6] * 3, [1 / 2, 0, 0]]),
        "seq-mean-token-sum": ((6 + 4) / 2, [[1 / 2] * 3, [1 / 2, 0, 0]]),
        "seq-mean-token-sum-norm": (10 / 3, [[1 / 3] * 3, [1 / 3, 0, 0]]),
        "seq-mean-token-scale": (
            (6 / 3 + 4 / 3) / 2,
            [[1 / 6] * 3, [1 / 6, 0, 0]],
        ),  # the mean over the 2 non-empty rows
    }
    for mode, (value, weights) in want.items():
        got, grad = jax.value_and_grad(aggregate_loss)(jnp.asarray(x), mask, mode)
        assert float(got) == pytest.approx(value, rel=1e-6), mode
        # The gradient is each token's weight: padding gets exactly 0 despite its nan/inf.
        np.testing.assert_allclose(grad, weights + [[0, 0, 0]], rtol=1e-6, err_msg=mode)
        # A float 0/1 mask too (XLA turns a bool mask times x into a select, but nan * 0. stays nan).
        assert float(aggregate_loss(x, mask.astype(np.float32), mode)) == pytest.approx(value, rel=1e-6), mode
        assert float(aggregate_loss(x, np.zeros_like(mask), mode)) == 0.0
    # Dr.GRPO's constant normalizer replaces the default T = 3: verl sums over rows, Dr.GRPO's own code averages them.
    assert float(aggregate_loss(x, mask, "seq-mean-token-sum-norm", norm_length=5)) == pytest.approx(2.0)
    assert float(aggregate_loss(x, mask, "seq-mean-token-scale", norm_length=5)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate_loss(x, mask, "seq-sum")
    with pytest.raises(ValueError, match=r"mask has shape \(3, 2\) but per_token has shape \(3, 3\)"):
        aggregate_loss(x, mask[:, :2], "token-mean")


@settings(max_examples=40, deadline=None)
@given(x=arrays(-3, 3), mask=masks, mode=st.sampled_from(MODES), norm=st.sampled_from((None, 4, 4096)))
def test_aggregation_matches_verl_agg_loss(x, mask, mode, norm):
    want = verl_agg_loss(x, mask, mode, norm)
    junk = np.where(mask, x, np.float32(np.nan))
    assert float(aggregate_loss(junk, mask, mode, norm_length=norm)) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_ppo_clip_loss_defaults_unchanged_and_aggregation_applies():
    mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
    old = np.zeros((2, 3), np.float32)
    adv = np.array([[1.0, 1.0, -1.0], [2.0, np.nan, np.nan]], np.float32)
    # Ratios 1.1, 0.9, 1.5 and 1.0; the clipped branch is never the active one (at 1.5, A < 0 and
    # -A ratio = 1.5 > 1.2 = -A clip(ratio)). Padding is nan.
    logp = np.log(np.array([[1.1, 0.9, 1.5], [1.0, np.nan, np.nan]], np.float32))
    per_token = np.array([[-1.1, -0.9, 1.5], [-2.0, 0.0, 0.0]])
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2)
    assert float(loss) == pytest.approx(per_token[mask].mean(), rel=1e-6)
    assert float(metrics["clip_fraction"]) == 0.0
    positional = ppo_clip_loss(logp, old, adv, mask)[0]
    explicit = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, aggregation="token-mean")[0]
    assert float(positional) == float(explicit) == float(loss)
    # Sequence mean of token means: ((-1.1 - 0.9 + 1.5) / 3 + -2) / 2; Dr.GRPO: token sum / 10.
    seq = ppo_clip_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean")[0]
    assert float(seq) == pytest.approx(((-0.5 / 3) - 2.0) / 2, rel=1e-6)
    dr = ppo_clip_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum-norm", norm_length=10)
    assert float(dr[0]) == pytest.approx(-2.5 / 10, rel=1e-6)
    # Metrics stay token-level whatever the aggregation, as verl's pg_clipfrac and ppo_kl.
    np.testing.assert_array_equal(dr[1]["approx_kl"], metrics["approx_kl"])
    with pytest.raises(ValueError, match="mode must be one of"):
        ppo_clip_loss(logp, old, adv, mask, aggregation="sum")


@settings(max_examples=30, deadline=None)
@given(logp=arrays(-5, 0), old=arrays(-5, 0), adv=arrays(-3, 3), mask=masks, mode=st.sampled_from(MODES))
def test_ppo_clip_loss_aggregation_matches_verl(logp, old, adv, mask, mode):
    ratio = np.exp(np.clip(logp.astype(np.float64) - old, -20, 20))
    per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.28))
    got = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.28, aggregation=mode, norm_length=16)[0]
    assert float(got) == pytest.approx(verl_agg_loss(per_token, mask, mode, 16), rel=1e-4, abs=1e-5)


def _gspo_case():
    """3 rows of 3 tokens, old log-probs 0. Row 0: mean log ratio 0.1, unclipped; row 1: 2 valid
    tokens (nan padding), mean -0.1, unclipped; row 2: mean 0.5, ratio e^0.5 > 1.2 with A > 0, clipped."""
    logp = np.array([[0.1, -0.1, 0.3], [-0.2, 0.0, np.nan], [0.5, 0.5, 0.5]], np.float32)
    old = np.where(np.isnan(logp), np.nan, 0.0).astype(np.float32)
    adv = np.array([[1.0, 2.0, 0.0], [-1.0, -1.0, np.nan], [1.0, 1.0, 1.0]], np.float32)
    mask = ~np.isnan(logp)
    return logp, old, adv, mask


@pytest.mark.parametrize("token_level", (False, True))
def test_gspo_by_hand(token_level):
    logp, old, adv, mask = _gspo_case()
    s0, s1 = np.exp(0.1), np.exp(-0.1)
    loss_fn = lambda x: gspo_loss(x, old, adv, mask, 0.2, 0.2, token_level=token_level)
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(logp))
    # Row means of -A s: row 0 (-s0 - 2 s0 + 0) / 3, row 1 (s1 + s1) / 2, row 2 -1.2 (clipped); mean over 3 rows.
    assert float(loss) == pytest.approx((-s0 + s1 - 1.2) / 3, rel=1e-6)
    assert float(metrics["clip_fraction"]) == pytest.approx(3 / 8)
    assert float(metrics["approx_kl"]) == pytest.approx(-1.6 / 8, rel=1e-6)
    if token_level:
        # d s_{i,t} / d logp_{i,t} = s_i, weighted by the row's 1 / (3 n_i): -A_t s0 / 9 and -A_t s1 / 6.
        want = [[-s0 / 9, -2 * s0 / 9, 0.0], [s1 / 6, s1 / 6, 0.0], [0.0, 0.0, 0.0]]
    else:
        # d s_i / d logp_{i,u} = s_i / n_i for every valid u: each token gets the row's summed weight.
        want = [[-3 * s0 / 27] * 3, [2 * s1 / 12, 2 * s1 / 12, 0.0], [0.0, 0.0, 0.0]]
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)


def test_gspo_clamps_the_sequence_log_ratio_above_only():
    old = np.zeros((1, 2), np.float32)
    mask = np.ones((1, 2), bool)
    # Mean log ratio 15 with A < 0 (unclipped branch active): verl clamps it to 10, the gradient is 0.
    up = np.full((1, 2), 15.0, np.float32)
    for token_level in (False, True):
        fn = lambda x: gspo_loss(x, old, -np.ones((1, 2), np.float32), mask, 0.2, 0.2, token_level=token_level)
        (loss, _), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(up))
        assert float(loss) == pytest.approx(np.exp(10.0), rel=1e-6)
        np.testing.assert_array_equal(grad, 0.0)
    # Mean log ratio -30 with A > 0 (unclipped branch active): no lower clamp, unlike PPO's -20.
    down = np.full((1, 2), -30.0, np.float32)
    loss = gspo_loss(down, old, np.ones((1, 2), np.float32), mask, 0.2, 0.2)[0]
    assert float(loss) == pytest.approx(-np.exp(-30.0), rel=1e-5)


@pytest.mark.parametrize("token_level", (False, True))
@settings(max_examples=30, deadline=None)
@given(
    logp=arrays(-2, 0),
    old=arrays(-2, 0),
    adv=arrays(-3, 3),
    mask=masks,
    clip=st.sampled_from(((0.2, 0.2), (3e-4, 4e-4), (0.1, 0.3))),
)
def test_gspo_matches_verl(token_level, logp, old, adv, mask, clip):
    lo, hi = clip
    want_loss, want_clipfrac, want_kl, ratio = verl_gspo(old, logp, adv, mask, lo, hi)
    junk = lambda x: np.where(mask, x, np.float32(np.nan))
    loss, metrics = gspo_loss(junk(logp), junk(old), junk(adv), mask, lo, hi, token_level=token_level)
    assert float(loss) == pytest.approx(want_loss, rel=1e-4, abs=1e-5)
    assert float(metrics["approx_kl"]) == pytest.approx(want_kl, rel=1e-4, abs=1e-5)
    # Clip fraction counts tokens where the clipped branch is strictly active (float noise aside).
    unclipped, clipped = -adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi)
    active = (clipped > unclipped + 1e-5)[mask].mean()
    maybe = (clipped > unclipped - 1e-5)[mask].mean()
    assert active - 1e-6 <= float(metrics["clip_fraction"]) <= maybe + 1e-6
    assert active - 1e-6 <= want_clipfrac <= maybe + 1e-6


@settings(max_examples=30, deadline=None)
@given(logp=arrays(-2, 0), old=arrays(-2, 0), adv=arrays(-3, 3), mask=masks)
def test_gspo_token_gradient_is_the_ppo_gradient_rescaled_by_the_sequence_ratio(logp, old, adv, mask):
    """Unclipped (wide clip range): verl's d/dlogp_t of -A sg(s_i) pi_t / sg(pi_t) is -A s_i, where PPO's
    per-token ratio gives -A r_t; under the same aggregation the gradients differ by s_i / r_t per token."""
    junk = lambda x: np.where(mask, x, np.float32(np.nan))
    wide = (100.0, 100.0)
    g_gspo = jax.grad(lambda x: gspo_loss(x, junk(old), junk(adv), mask, *wide, token_level=True)[0])(junk(logp))
    g_ppo = jax.grad(
        lambda x: ppo_clip_loss(x, junk(old), junk(adv), mask, *wide, aggregation="seq-mean-token-mean")[0]
    )(junk(logp))
    *_, s = verl_gspo(old, logp, adv, mask, *wide)
    r = np.exp(logp.astype(np.float64) - old)
    np.testing.assert_allclose(g_gspo, np.where(mask, np.asarray(g_ppo) * s / r, 0.0), rtol=1e-4, atol=1e-7)
    assert np.all(np.asarray(g_gspo)[~mask] == 0.0)


@settings(max_examples=30, deadline=None)
@given(logp=arrays(-2, 0), old=arrays(-2, 0), adv=arrays(-3, 3), mask=masks)
def test_gspo_sequence_gradient_spreads_over_the_row(logp, old, adv, mask):
    """Unclipped: d/dlogp_u of sum_t w_t (-A_t s_i) = (s_i / n_i) sum_t w_t (-A_t) for every valid u of row i,
    with w_t = 1 / (n_i |S|); with A constant along rows it equals the GSPO-token gradient."""
    junk = lambda x: np.where(mask, x, np.float32(np.nan))
    wide = (100.0, 100.0)
    grad = lambda a, token_level: np.asarray(
        jax.grad(lambda x: gspo_loss(x, junk(old), junk(a), mask, *wide, token_level=token_level)[0])(junk(logp))
    )
    *_, s = verl_gspo(old, logp, adv, mask, *wide)
    n = mask.sum(axis=1, keepdims=True)
    w = np.where(mask, 1.0 / (np.maximum(n, 1) * (n > 0).sum()), 0.0)
    row = (w * -adv.astype(np.float64)).sum(axis=1, keepdims=True) * s / np.maximum(n, 1)
    np.testing.assert_allclose(grad(adv, False), np.where(mask, row, 0.0), rtol=1e-4, atol=1e-7)
    constant = np.repeat(adv[:, :1], adv.shape[1], axis=1)
    np.testing.assert_allclose(grad(constant, False), grad(constant, True), rtol=1e-4, atol=1e-7)


def areal_decoupled_loss(logp, proximal, behaviour, adv, mask, eps, cap, rule="mask"):
    """AReaL's decoupled PPO loss (Fu et al. 2025, eq. 5) written out token by token, float64. Rule "mask"
    is AReaL's `behav_imp_weight_cap` (areal `ppo_actor_loss_fn`): a weight over the cap becomes 0 and the
    sum is still divided by every valid token (its `loss_mask_count`); "truncate" is min(w, cap)."""
    total, count = 0.0, 0
    for b, t in zip(*np.nonzero(mask)):
        weight = np.exp(float(proximal[b, t]) - float(behaviour[b, t]))
        weight = (0.0 if weight > cap else weight) if rule == "mask" else min(weight, cap)
        ratio = np.exp(float(logp[b, t]) - float(proximal[b, t]))
        total += -weight * min(ratio * adv[b, t], np.clip(ratio, 1 - eps, 1 + eps) * adv[b, t])
        count += 1
    return total / max(count, 1)


@settings(max_examples=40, deadline=None)
@given(
    logp=arrays(-4, 0),
    proximal=arrays(-4, 0),
    behaviour=arrays(-4, 0),
    adv=arrays(-3, 3),
    mask=masks,
    cap=st.sampled_from((1.5, 5.0)),
    rule=st.sampled_from(IMPORTANCE_WEIGHT_RULES),
)
def test_the_decoupled_objective_is_areals_loss_by_hand_and_its_gradient_is_the_weighted_ppo_gradient(
    logp, proximal, behaviour, adv, mask, cap, rule
):
    exact = np.exp(proximal.astype(np.float64) - behaviour)
    assume(not np.any(np.isclose(exact[mask], cap, rtol=1e-4)))  # float32 and float64 agree on which side of the cap
    old, weighted, weights, capped = decoupled_ppo_inputs(behaviour, proximal, adv, mask, cap, rule)
    loss = lambda lp: ppo_clip_loss(lp, old, weighted, mask, 0.2, 0.2)[0]
    oracle = lambda lp: areal_decoupled_loss(lp, proximal, behaviour, adv, mask, 0.2, cap, rule)
    assert float(loss(logp)) == pytest.approx(oracle(logp), rel=1e-4, abs=1e-5)
    np.testing.assert_allclose(np.asarray(weights)[mask], exact[mask], rtol=1e-5)
    kept = np.where(exact > cap, 0.0, exact) if rule == "mask" else np.minimum(exact, cap)
    np.testing.assert_allclose(np.asarray(capped)[mask], kept[mask], rtol=1e-5)
    assert not np.asarray(weights)[~mask].any() and not np.asarray(capped)[~mask].any()
    # d/dlogp of the hand-written loss, by central differences on one valid token.
    if mask.any():
        b, t = map(int, np.argwhere(mask)[0])
        step = np.zeros(SHAPE, np.float32)
        step[b, t] = 1e-3
        numeric = (oracle(logp + step) - oracle(logp - step)) / 2e-3
        ratio = np.exp(float(logp[b, t]) - float(proximal[b, t]))
        if abs(ratio - 0.8) > 2e-3 and abs(ratio - 1.2) > 2e-3:  # away from the clip's kinks
            assert float(jax.grad(loss)(logp)[b, t]) == pytest.approx(numeric, rel=2e-2, abs=1e-4)


@pytest.mark.parametrize("rule, kept", [("mask", 0.0), ("truncate", 5.0)])
def test_a_non_finite_proximal_log_prob_gives_a_non_finite_weight_and_one_far_off_is_masked_or_truncated(rule, kept):
    mask = np.ones((1, 3), bool)
    behaviour = np.zeros((1, 3), np.float32)
    proximal = np.array([[np.nan, 30.0, 0.0]], np.float32)
    _, weighted, weights, _ = decoupled_ppo_inputs(behaviour, proximal, np.ones((1, 3), np.float32), mask, 5.0, rule)
    assert np.isnan(weights[0, 0]) and np.isnan(weighted[0, 0])  # the learner's guard names "importance weights"
    assert float(weighted[0, 1]) == kept and float(weighted[0, 2]) == 1.0
