"""Comp-GAE, GAE, the transport kernel, GRPO, Dr.GRPO, DAPO's group filter, whitening and clipping
against NumPy oracles."""

from __future__ import annotations

import credit_oracles as oracle
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from comppo_jax import comp_gae, gae, grpo_advantages, retention_gate
from comppo_jax.credit import (
    advantages,
    clip_advantages,
    gate_range,
    informative_groups,
    transport_kernel,
    whiten_advantages,
)

METHODS = ("scan", "associative")
# Few distinct shapes keep the number of compilations (and the test time) small.
SHAPES = ((1, 1), (2, 7), (3, 16))
KAPPA_LO, KAPPA_HI = gate_range()


def floats(lo, hi):
    return st.floats(float(np.float32(lo)), float(np.float32(hi)), allow_nan=False, width=32)


@st.composite
def rollouts(draw, right_padded=False):
    """(rewards, values, kappa, mask, lam) with dense rewards (the estimator does not assume terminal ones)."""
    shape = draw(st.sampled_from(SHAPES))
    rewards = draw(hnp.arrays(np.float32, shape, elements=floats(-2, 2)))
    values = draw(hnp.arrays(np.float32, shape, elements=floats(-1, 1)))
    kappa = draw(hnp.arrays(np.float32, shape, elements=floats(0, 0.95)))
    if right_padded:
        lengths = draw(st.lists(st.integers(0, shape[1]), min_size=shape[0], max_size=shape[0]))
        mask = np.arange(shape[1])[None] < np.asarray(lengths)[:, None]
    else:
        mask = draw(hnp.arrays(np.bool_, shape))
    lam = draw(st.sampled_from((0.0, 0.5, 0.95, 1.0)))
    return rewards, values, kappa, mask, lam


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=40, deadline=None)
@given(batch=rollouts())
def test_comp_gae_matches_recursion_oracle_on_any_mask(method, batch):
    rewards, values, kappa, mask, lam = batch
    adv, ret = comp_gae(rewards, values, kappa, mask, lam, method=method)
    want_adv, want_ret = oracle.comp_gae_loop(rewards, values, kappa, mask, lam)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
    assert adv.dtype == ret.dtype == jnp.float32


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=30, deadline=None)
@given(batch=rollouts(right_padded=True))
def test_comp_gae_equals_unrolled_kernel_sum(method, batch):
    """Paper eq. (unrolled)."""
    rewards, values, kappa, mask, lam = batch
    delta = oracle.td_residuals(rewards, values, kappa, mask)
    want = oracle.unrolled_advantages(delta, kappa, mask.sum(axis=1), lam)
    adv, _ = comp_gae(rewards, values, kappa, mask, lam, method=method)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(batch=rollouts())
def test_comp_gae_equals_transport_kernel_times_delta(batch):
    """Paper eq. (cct_matrix): A = K delta, with K built by `transport_kernel`."""
    rewards, values, kappa, mask, lam = batch
    kernel = np.asarray(transport_kernel(kappa, lam, mask), np.float64)
    delta = oracle.td_residuals(rewards, values, kappa, mask)
    adv, _ = comp_gae(rewards, values, kappa, mask, lam)
    np.testing.assert_allclose(adv, np.einsum("btu,bu->bt", kernel, delta), rtol=1e-5, atol=1e-5)


def test_transport_kernel_entries_and_sensitivity():
    """Eq. (cct_kernel) entry by entry, and eq. (sensitivity): dA_t / d r_u = K[t, u] (r enters delta_u with
    weight 1)."""
    rng = np.random.default_rng(0)
    kappa = rng.uniform(0.1, 0.9, (2, 6)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1]], bool)
    lam = 0.9
    kernel = np.asarray(transport_kernel(kappa, lam, mask))
    for b in range(2):
        for t in range(6):
            for u in range(6):
                want = 0.0
                if u >= t and mask[b, t] and mask[b, t : u + 1].all():
                    want = lam ** (u - t) * np.prod(kappa[b, t:u].astype(np.float64))
                assert kernel[b, t, u] == pytest.approx(want, rel=1e-5, abs=1e-7), (b, t, u)
    values = rng.normal(size=(2, 6)).astype(np.float32)
    jac = jax.jacobian(lambda r: comp_gae(r, values, kappa, mask, lam)[0])(jnp.zeros((2, 6)))
    np.testing.assert_allclose(jac[0, :, 0, :], kernel[0], atol=1e-6)
    np.testing.assert_allclose(jac[1, :, 1, :], kernel[1], atol=1e-6)
    np.testing.assert_allclose(transport_kernel(kappa, lam), transport_kernel(kappa, lam, np.ones_like(mask)))


def test_constant_kappa_kernel_is_toeplitz():
    """Eq. (toeplitz): with kappa = gamma, K[t, u] = (lam gamma)^(u - t)."""
    kernel = np.asarray(transport_kernel(jnp.full((1, 5), 0.8), 0.5))[0]
    t, u = np.meshgrid(np.arange(5), np.arange(5), indexing="ij")
    np.testing.assert_allclose(kernel, np.where(u >= t, 0.4 ** (u - t), 0.0), rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=30, deadline=None)
@given(batch=rollouts(), gamma=st.sampled_from((0.9, 0.99, 1.0)))
def test_constant_kappa_equals_standard_gae(method, batch, gamma):
    """Strict reduction (paper app. D): kappa = gamma is GAE, eq. (stdgae), on any mask."""
    rewards, values, _, mask, lam = batch
    got = gae(rewards, values, mask, gamma, lam, method=method)
    same = comp_gae(rewards, values, np.full(rewards.shape, gamma, np.float32), mask, lam, method=method)
    want = oracle.comp_gae_loop(rewards, values, np.full(rewards.shape, gamma), mask, lam)
    for g, s, w in zip(got, same, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(s))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(batch=rollouts(right_padded=True), gamma=st.sampled_from((0.9, 0.99, 1.0)))
def test_gae_matches_ppo_trainer_loop_on_right_padded_batches(batch, gamma):
    rewards, values, _, mask, lam = batch
    adv, ret = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = oracle.ppo_trainer_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_scan_and_associative_agree_at_16k_tokens(seed):
    rng = np.random.default_rng(seed)
    batch, length = 2, 16384
    lengths = rng.integers(1, length + 1, batch)
    mask = np.arange(length)[None] < lengths[:, None]
    rewards = np.zeros((batch, length), np.float32)
    rewards[np.arange(batch), lengths - 1] = rng.choice([-1.0, 1.0], batch)
    values = rng.uniform(-1, 1, (batch, length)).astype(np.float32)
    kappa = rng.uniform(KAPPA_LO, KAPPA_HI, (batch, length)).astype(np.float32)
    scan = comp_gae(rewards, values, kappa, mask, 0.95, method="scan")
    assoc = comp_gae(rewards, values, kappa, mask, 0.95, method="associative")
    for a, b in zip(scan, assoc):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=40, deadline=None)
@given(batch=rollouts(), c=hnp.arrays(np.float32, (3, 16), elements=floats(0, 1)))
def test_bounded_trace(method, batch, c):
    """|A_t| <= D / (1 - lam kappa_bar) with D = max |delta| and kappa_bar the largest realized gate."""
    rewards, values, _, mask, lam = batch
    kappa = np.asarray(retention_gate(c[: rewards.shape[0], : rewards.shape[1]]))
    adv, _ = comp_gae(rewards, values, kappa, mask, lam, method=method)
    delta = oracle.td_residuals(rewards, values, kappa, mask)
    kappa_bar = kappa.max()
    assert kappa_bar <= KAPPA_HI + 1e-6
    bound = np.abs(delta).max() / (1.0 - lam * kappa_bar)
    assert np.all(np.abs(adv) <= bound * (1 + 1e-5) + 1e-6)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=30, deadline=None)
@given(batch=rollouts(), junk=st.sampled_from((np.nan, np.inf, -1e30, 7.0)))
def test_padding_never_leaks_and_yields_zeros(method, batch, junk):
    rewards, values, kappa, mask, lam = batch
    clean = comp_gae(rewards, values, kappa, mask, lam, method=method)
    dirty_inputs = [np.where(mask, x, np.float32(junk)) for x in (rewards, values, kappa)]
    dirty = comp_gae(*dirty_inputs, mask, lam, method=method)
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.all(np.asarray(b)[~mask] == 0.0)


@pytest.mark.parametrize("method", METHODS)
def test_rows_are_independent(method):
    rng = np.random.default_rng(1)
    shape = (3, 16)
    rewards, values = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
    kappa = rng.uniform(0.1, 0.9, shape).astype(np.float32)
    mask = np.arange(16)[None] < np.array([[16], [5], [11]])
    base = comp_gae(rewards, values, kappa, mask, 0.95, method=method)
    # Scramble row 1 entirely: rows 0 and 2 must not move.
    changed = [x.copy() for x in (rewards, values, kappa)]
    for x in changed:
        x[1] = rng.normal(size=16)
    other_mask = mask.copy()
    other_mask[1] = rng.random(16) < 0.5
    after = comp_gae(*changed, other_mask, 0.95, method=method)
    for a, b in zip(base, after):
        np.testing.assert_array_equal(np.asarray(a)[[0, 2]], np.asarray(b)[[0, 2]])
    # A row computed alone equals the same row in the batch.
    alone = comp_gae(rewards[2:], values[2:], kappa[2:], mask[2:], 0.95, method=method)
    np.testing.assert_allclose(alone[0][0], base[0][2], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("batch", (8, 12, 16, 65, 72))
def test_cpu_row_groups_equal_one_loop_over_all_rows(batch):
    """On CPU method="scan" runs 8-row groups (a loop each up to 64 rows, a lax.map
    beyond, leftover rows apart); every layout equals the oracle and, bit for bit,
    the single loop accelerators run."""
    rng = np.random.default_rng(batch)
    shape = (batch, 9)
    rewards, values = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
    kappa = rng.uniform(0.1, 0.9, shape).astype(np.float32)
    mask = rng.random(shape) < 0.8
    adv, ret = comp_gae(rewards, values, kappa, mask, 0.95)
    want_adv, want_ret = oracle.comp_gae_loop(rewards, values, kappa, mask, 0.95)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
    one_loop = jax.jit(advantages._reverse_scan)(rewards, kappa)
    np.testing.assert_array_equal(jax.jit(advantages._reverse_scan_cpu)(rewards, kappa), one_loop)


def test_lam_may_be_traced_and_inputs_low_precision():
    rng = np.random.default_rng(2)
    shape = (2, 7)
    args = [rng.normal(size=shape).astype(np.float32) for _ in range(2)] + [
        rng.uniform(0.1, 0.9, shape).astype(np.float32),
        np.ones(shape, bool),
    ]
    over_lam = jax.jit(jax.vmap(lambda lam: comp_gae(*args, lam)[0]))(jnp.array([0.0, 0.5, 0.95]))
    for i, lam in enumerate((0.0, 0.5, 0.95)):
        np.testing.assert_allclose(over_lam[i], oracle.comp_gae_loop(*args, lam)[0], rtol=1e-5, atol=1e-5)
    low = [jnp.asarray(x, jnp.bfloat16) for x in args[:3]]
    adv, ret = comp_gae(*low, args[3], 0.95)
    assert adv.dtype == ret.dtype == jnp.float32
    want = oracle.comp_gae_loop(*[np.asarray(x, np.float32) for x in low], args[3], 0.95)[0]
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)


def test_shape_and_argument_errors_name_the_tensor():
    ok = np.zeros((2, 5), np.float32)
    mask = np.ones((2, 5), bool)
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\) but rewards has shape \(2, 5\)"):
        comp_gae(ok, np.zeros((2, 4), np.float32), ok, mask)
    with pytest.raises(ValueError, match=r"kappa must have shape \[B, T\], got shape \(5,\)"):
        comp_gae(ok, ok, np.zeros(5, np.float32), mask)
    with pytest.raises(ValueError, match=r"mask has shape \(5, 2\)"):
        comp_gae(ok, ok, ok, mask.T)
    with pytest.raises(ValueError, match=r"rewards must have a floating dtype, got int32"):
        comp_gae(np.zeros((2, 5), np.int32), ok, ok, mask)
    with pytest.raises(ValueError, match="method must be one of"):
        comp_gae(ok, ok, ok, mask, method="cumsum")
    with pytest.raises(ValueError, match=r"rewards must have shape \[B, T\]"):
        gae(np.zeros(5, np.float32), ok, mask)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\) but kappa has shape \(2, 5\)"):
        transport_kernel(ok, 0.9, np.ones((2, 4), bool))


@settings(max_examples=40, deadline=None)
@given(
    group_size=st.sampled_from((1, 2, 4)),
    rewards=hnp.arrays(np.float32, 8, elements=st.sampled_from((0.0, 0.5, 1.0)) | floats(-3, 3)),
    lengths=st.lists(st.integers(0, 6), min_size=8, max_size=8),
)
def test_grpo_matches_group_formula(group_size, rewards, lengths):
    mask = np.arange(6)[None] < np.asarray(lengths)[:, None]
    got = np.asarray(grpo_advantages(rewards, group_size, mask))
    want = oracle.grpo(rewards, group_size)[:, None] * mask
    # float32 loses eps * |r| when it subtracts the group mean, and dividing by the std magnifies
    # that: nearly tied groups (1.0 vs 0.999) are exact only up to eps * max|r| / std.
    groups = rewards.astype(np.float64).reshape(-1, group_size)
    spread = groups.std(axis=1, ddof=1) if group_size > 1 else np.zeros(len(groups))
    conditioning = np.abs(groups).max(axis=1) / (spread + 1e-6)
    tolerance = 1e-5 + 10 * np.finfo(np.float32).eps * np.repeat(conditioning, group_size)[:, None]
    assert (np.abs(got - want) <= tolerance).all(), (got, want)


def test_grpo_tied_groups_get_zero_and_bad_group_size_is_refused():
    mask = np.ones((4, 3), bool)
    got = np.asarray(grpo_advantages(np.array([1.0, 1.0, 0.0, 1.0], np.float32), 2, mask))
    np.testing.assert_array_equal(got[:2], 0.0)
    # Two rewards: unbiased std = |a - b| / sqrt(2), so the scores are +-1/sqrt(2).
    np.testing.assert_allclose(got[2:, 0], [-(2**-0.5), 2**-0.5], rtol=1e-5)
    # 3 x 2.9 has a float32 mean one ulp off 2.9: without the tie rule the group would get
    # (R - mean) / eps = O(0.2) instead of 0.
    tied3 = np.asarray(grpo_advantages(np.full(3, 2.9, np.float32), 3, np.ones((3, 2), bool)))
    np.testing.assert_array_equal(tied3, 0.0)
    with pytest.raises(ValueError, match=r"group_size must be a positive int dividing the batch size B = 4"):
        grpo_advantages(np.zeros(4, np.float32), 3, mask)
    with pytest.raises(ValueError, match=r"mask has shape \(3, 3\) but rewards has shape \(4,\)"):
        grpo_advantages(np.zeros(4, np.float32), 2, np.ones((3, 3), bool))
    with pytest.raises(ValueError, match=r"rewards must have shape \[B\]"):
        grpo_advantages(np.zeros((4, 3), np.float32), 2, mask)


def verl_grpo_outcome_advantage(scores, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """NumPy transcription of verl core_algos.compute_grpo_outcome_advantage on [B] scores (float64)."""
    scores = np.asarray(scores, np.float64).copy()
    id2score = {}
    for i, idx in enumerate(index):
        id2score.setdefault(idx, []).append(scores[i])
    id2mean, id2std = {}, {}
    for idx, vals in id2score.items():
        if len(vals) == 1:
            id2mean[idx], id2std[idx] = 0.0, 1.0
        else:
            id2mean[idx], id2std[idx] = np.mean(vals), np.std(vals, ddof=1)
    for i, idx in enumerate(index):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[idx]) / (id2std[idx] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[idx]
    return scores


@settings(max_examples=40, deadline=None)
@given(
    group_size=st.sampled_from((2, 4)),
    rewards=hnp.arrays(np.float32, 8, elements=st.sampled_from((0.0, 0.5, 1.0)) | floats(-3, 3)),
    lengths=st.lists(st.integers(0, 6), min_size=8, max_size=8),
)
def test_dr_grpo_matches_verl_without_std_normalization(group_size, rewards, lengths):
    mask = np.arange(6)[None] < np.asarray(lengths)[:, None]
    got = np.asarray(grpo_advantages(rewards, group_size, mask, normalize_std=False))
    index = np.repeat(np.arange(8 // group_size), group_size)
    want = verl_grpo_outcome_advantage(rewards, index, norm_adv_by_std_in_grpo=False)[:, None] * mask
    # Tied groups are exactly 0 here; verl's float mean can leave an ulp of residue.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Same ranking as GRPO: the std only rescales each group.
    np.testing.assert_array_equal(np.sign(got), np.sign(np.asarray(grpo_advantages(rewards, group_size, mask))))


def test_dr_grpo_by_hand_and_grpo_default_unchanged():
    rewards = np.array([1.0, 0.0, 0.5, 0.5, 3.0, 0.0, 0.0, 0.0], np.float32)
    mask = np.array([[1, 1, 0]] * 8, bool)
    got = np.asarray(grpo_advantages(rewards, 2, mask, normalize_std=False))
    np.testing.assert_allclose(got[:, 0], [0.5, -0.5, 0.0, 0.0, 1.5, -1.5, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(got[:, 2], 0.0)
    # Groups of 4: means 0.5 and 0.75; the second group's reward 3 dominates without the std.
    got4 = np.asarray(grpo_advantages(rewards, 4, mask, normalize_std=False))
    np.testing.assert_allclose(got4[:, 0], [0.5, -0.5, 0.0, 0.0, 2.25, -0.75, -0.75, -0.75], rtol=1e-6)
    # Ties are exactly 0, though the float32 mean of 3 x 2.9 is an ulp off 2.9.
    tied3 = grpo_advantages(np.full(3, 2.9, np.float32), 3, np.ones((3, 2), bool), normalize_std=False)
    np.testing.assert_array_equal(tied3, 0.0)
    # The default is GRPO, as before: (R - mean) / (std + eps), std of (1, 0) = 1 / sqrt(2).
    default = np.asarray(grpo_advantages(rewards, 2, mask))
    np.testing.assert_array_equal(default, np.asarray(grpo_advantages(rewards, 2, mask, 1e-6, normalize_std=True)))
    np.testing.assert_allclose(default[:2, 0], [0.5 / (2**-0.5 + 1e-6), -0.5 / (2**-0.5 + 1e-6)], rtol=1e-6)
    np.testing.assert_allclose(
        default, verl_grpo_outcome_advantage(rewards, np.repeat(np.arange(4), 2))[:, None] * mask, rtol=1e-5, atol=1e-6
    )


def test_informative_groups_by_hand():
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25], np.float32)
    keep = informative_groups(rewards, 2)
    assert isinstance(keep, np.ndarray) and keep.dtype == np.bool_
    np.testing.assert_array_equal(keep, [False, True, False, True])
    np.testing.assert_array_equal(informative_groups(jnp.asarray(rewards), 4), [True, True])
    # Exact equality: 3 x 2.9 is tied even though its float32 mean is an ulp off 2.9, and a
    # group of one is never informative; both get zero GRPO advantage.
    np.testing.assert_array_equal(informative_groups(np.full(3, 2.9, np.float32), 3), [False])
    np.testing.assert_array_equal(informative_groups(rewards, 1), np.zeros(8, bool))
    with pytest.raises(ValueError, match=r"group_size must be a positive int dividing the batch size B = 8"):
        informative_groups(rewards, 3)
    with pytest.raises(ValueError, match=r"rewards must have shape \[B\]"):
        informative_groups(rewards.reshape(4, 2), 2)


# Rewards at least 1e-6 from 0: XLA:CPU flushes subnormals to zero, so JAX ties a group whose
# mean or differences are subnormal, (0, 1e-43) or (0, 1.2e-38), that NumPy does not.
@settings(max_examples=40, deadline=None)
@given(
    group_size=st.sampled_from((1, 2, 4)),
    rewards=hnp.arrays(
        np.float32,
        8,
        elements=st.sampled_from((0.0, 0.5, 1.0)) | st.floats(-3, 3, width=32).filter(lambda x: abs(x) >= 1e-6),
    ),
)
def test_informative_groups_are_those_with_nonzero_grpo_advantages(group_size, rewards):
    keep = informative_groups(rewards, group_size)
    for normalize_std in (True, False):
        adv = np.asarray(grpo_advantages(rewards, group_size, np.ones((8, 1), bool), normalize_std=normalize_std))
        np.testing.assert_array_equal(keep, (adv.reshape(-1, group_size) != 0).any(axis=1))


@settings(max_examples=30, deadline=None)
@given(batch=rollouts())
def test_whitening_matches_verl_masked_whiten(batch):
    advantages, _, _, mask, _ = batch
    # Near-constant inputs make (A - mean) pure float32 rounding noise, amplified by rsqrt(eps).
    assume(mask.sum() >= 2 and advantages[mask].std() > 1e-3)
    junk = np.where(mask, advantages, np.float32(np.nan))
    got = np.asarray(whiten_advantages(junk, mask))
    np.testing.assert_allclose(got, oracle.masked_whiten(advantages, mask), rtol=1e-4, atol=1e-4)
    assert np.all(got[~mask] == 0.0)


def test_clip_advantages():
    got = clip_advantages(jnp.array([[-9.0, -1.0, 0.0, 2.0, 6.0]]), 5.0)
    np.testing.assert_array_equal(got, [[-5.0, -1.0, 0.0, 2.0, 5.0]])


@pytest.mark.parametrize(
    "call",
    [
        lambda x, m: comp_gae(x, x, x, m, 1.5),
        lambda x, m: comp_gae(x, x, x, m, lam=-0.1),
        lambda x, m: gae(x, x, m, gamma=1.01),
        lambda x, m: gae(x, x, m, lam=2),
        lambda x, m: transport_kernel(x, 1.5, m),
    ],
)
def test_out_of_range_python_lam_or_gamma_is_refused_naming_it(call):
    x, mask = np.zeros((2, 5), np.float32), np.ones((2, 5), bool)
    with pytest.raises(ValueError, match=r"(lam|gamma) must be in \[0, 1\], got"):
        call(x, mask)


def test_range_checks_keep_the_jitted_api():
    x, mask = np.zeros((2, 5), np.float32), np.ones((2, 5), bool)
    assert comp_gae.lower(x, x, x, mask, 0.9).compile() is not None
    assert "paper eqs. (comp_td) and (comp_gae)" in comp_gae.__doc__
    np.testing.assert_array_equal(jax.jit(comp_gae)(x, x, x, mask, 0.9)[0], comp_gae(x, x, x, mask, 0.9)[0])
