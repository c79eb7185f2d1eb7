"""Normalized concentration, the retention gate and the fixed / shuffled gate controls."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comppo_jax import fixed_gate, normalized_concentration, retention_gate, shuffle_gate
from comppo_jax.credit import (
    FIXED_GATE,
    GATE_STATISTICS,
    entropy_concentration,
    gate_concentration,
    gate_range,
    max_weight_concentration,
    statistic_concentration,
)


def herfindahl(probs):
    return np.sum(np.asarray(probs, np.float64) ** 2)


@settings(max_examples=60, deadline=None)
@given(weights=hnp.arrays(np.float64, st.integers(1, 40), elements=st.floats(0, 1)), point=st.booleans())
def test_concentration_is_the_normalized_log_herfindahl(weights, point):
    """Eq. (cnorm) on random attention rows, including the uniform and point-mass extremes."""
    n = weights.shape[0]
    if point or weights.sum() == 0:
        weights = np.eye(n)[0]
    probs = weights / weights.sum()
    h = herfindahl(probs)
    c = float(normalized_concentration(jnp.array([[h]], jnp.float32), jnp.array([[n]], jnp.int32))[0, 0])
    if n < 2:
        assert c == 0.5
    else:
        assert c == pytest.approx(min(max(math.log(n * h) / math.log(n), 0.0), 1.0), abs=1e-5)
        assert 0.0 <= c <= 1.0


@settings(max_examples=60, deadline=None)
@given(weights=hnp.arrays(np.float64, st.integers(1, 40), elements=st.floats(0, 1)), point=st.booleans())
def test_entropy_and_max_weight_concentrations_follow_their_formulas(weights, point):
    """c = 1 - E / log n and c = log(n a_max) / log n on random rows: the same endpoints as eq. cnorm."""
    n = weights.shape[0]
    if point or weights.sum() == 0:
        weights = np.eye(n)[0]
    probs = weights / weights.sum()
    entropy = -np.sum(probs[probs > 0] * np.log(probs[probs > 0]))
    as_array = lambda x: jnp.array([[x]], jnp.float32)
    c_entropy = float(entropy_concentration(as_array(entropy), jnp.array([[n]], jnp.int32))[0, 0])
    c_max = float(max_weight_concentration(as_array(probs.max()), jnp.array([[n]], jnp.int32))[0, 0])
    if n < 2:
        assert c_entropy == c_max == 0.5
        return
    assert c_entropy == pytest.approx(min(max(1 - entropy / math.log(n), 0.0), 1.0), abs=1e-5)
    assert c_max == pytest.approx(min(max(math.log(n * probs.max()) / math.log(n), 0.0), 1.0), abs=1e-5)
    if point:
        assert c_entropy == pytest.approx(1.0) and c_max == pytest.approx(1.0)
    # Renyi entropies fall with their order (1, 2, infinity), so the concentrations rise with it.
    c_herfindahl = float(normalized_concentration(as_array(herfindahl(probs)), jnp.array([[n]], jnp.int32))[0, 0])
    assert c_entropy <= c_herfindahl + 1e-5 <= c_max + 2e-5


def test_every_gate_statistic_maps_uniform_to_zero_one_hot_to_one_and_short_windows_to_a_half():
    n = jnp.array([[1, 5, 5, 0]], jnp.int32)
    uniform = {"herfindahl": 0.2, "sink_herfindahl": 0.2, "entropy": math.log(5), "max_weight": 0.2}
    for name in GATE_STATISTICS:
        values = jnp.array([[0.0, uniform[name], 1.0 if name != "entropy" else 0.0, 0.0]], jnp.float32)
        np.testing.assert_allclose(
            statistic_concentration(name, values, n), [[0.5, 0.0, 1.0, 0.5]], atol=1e-6, err_msg=name
        )
    with pytest.raises(ValueError, match=r"gate statistic 'renyi' is not one of"):
        statistic_concentration("renyi", values, n)


def test_concentration_extremes_short_windows_and_padding():
    n = np.array([[0, 1, 2, 8, 8, 100, 5]], np.int32)
    h = np.array([[0.0, 1.0, 0.5, 1 / 8, 1.0, 1 / 100, 0.0]], np.float32)
    got = np.asarray(normalized_concentration(h, n))
    # n < 2 -> 1/2; uniform -> 0; point mass -> 1; H = 0 (padding) clips to 0, not nan.
    np.testing.assert_allclose(got, [[0.5, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0]], atol=1e-6)
    # Monotone in H at fixed n.
    hs = np.linspace(1 / 16, 1, 50, dtype=np.float32)[None]
    cs = np.asarray(normalized_concentration(hs, np.full(hs.shape, 16, np.int32)))
    assert np.all(np.diff(cs) > 0)
    with pytest.raises(ValueError, match=r"n has shape \(1, 6\) but herfindahl has shape \(1, 7\)"):
        normalized_concentration(h, n[:, :6])


def test_retention_gate_formula_and_strict_range():
    c = np.linspace(0, 1, 101, dtype=np.float32)[None]
    kappa = np.asarray(retention_gate(c))
    want = 0.1 + 0.8 / (1 + np.exp(-4.0 * (c.astype(np.float64) - 0.5)))
    np.testing.assert_allclose(kappa, want, rtol=1e-6)
    g0, g1 = gate_range()
    assert 0.1 < g0 < g1 < 0.9
    assert g0 == pytest.approx(0.1 + 0.8 / (1 + math.exp(2.0)))
    assert g1 == pytest.approx(0.1 + 0.8 / (1 + math.exp(-2.0)))
    assert kappa[0, 0] == pytest.approx(g0, rel=1e-6) and kappa[0, -1] == pytest.approx(g1, rel=1e-6)
    assert np.all(np.diff(kappa) > 0)
    other = np.asarray(retention_gate(c, kappa_lo=0.0, kappa_hi=1.0, tau=8.0))
    np.testing.assert_allclose(other, 1 / (1 + np.exp(-8.0 * (c.astype(np.float64) - 0.5))), rtol=1e-6)
    with pytest.raises(ValueError, match="kappa_lo <= kappa_hi"):
        retention_gate(c, kappa_lo=0.9, kappa_hi=0.1)
    with pytest.raises(ValueError, match="tau must be positive"):
        gate_range(tau=0.0)


@settings(max_examples=60, deadline=None)
@given(
    h=hnp.arrays(np.float32, (2, 9), elements=st.floats(0, 1, width=32)),
    n=hnp.arrays(np.int32, (2, 9), elements=st.integers(0, 10_000)),
)
def test_gate_range_is_the_strict_subinterval(h, n):
    """Whatever H and n (even inconsistent ones), kappa stays in [g(0), g(1)] inside (kappa_lo, kappa_hi)."""
    kappa = np.asarray(retention_gate(normalized_concentration(h, n)))
    g0, g1 = gate_range()
    assert np.all(kappa >= np.float32(g0) * (1 - 1e-6))
    assert np.all(kappa <= np.float32(g1) * (1 + 1e-6))
    assert np.all((kappa > 0.1) & (kappa < 0.9))


def test_fixed_gate():
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    np.testing.assert_array_equal(fixed_gate(mask), np.where(mask, np.float32(FIXED_GATE), 0.0))
    np.testing.assert_array_equal(fixed_gate(mask, 0.3), np.where(mask, np.float32(0.3), 0.0))
    assert FIXED_GATE == 0.61


def test_shuffle_gate_is_one_global_permutation_of_valid_positions():
    rng = np.random.default_rng(0)
    shape = (4, 32)
    lengths = np.array([32, 20, 3, 0])
    mask = np.arange(32)[None] < lengths[:, None]
    mask[0, 5] = False  # non-contiguous masks are permuted too
    kappa = np.where(mask, rng.permutation(128).reshape(shape) / 128.0, -1.0).astype(np.float32)
    out = np.asarray(shuffle_gate(kappa, mask, jax.random.key(3)))
    # Same multiset over the batch's valid positions; padding untouched.
    np.testing.assert_array_equal(np.sort(out[mask]), np.sort(kappa[mask]))
    np.testing.assert_array_equal(out[~mask], kappa[~mask])
    # Global: values move between rows, and most positions change.
    assert np.any(np.sort(out[1][mask[1]]) != np.sort(kappa[1][mask[1]]))
    assert np.mean(out[mask] != kappa[mask]) > 0.8
    # Seeded: same key, same permutation; another key, another one.
    np.testing.assert_array_equal(out, shuffle_gate(kappa, mask, jax.random.key(3)))
    assert np.any(out != np.asarray(shuffle_gate(kappa, mask, jax.random.key(4))))


def test_shuffle_gate_is_uniform_over_positions():
    """Each valid value lands in each valid slot with probability 1/n (chi-square-free check on a tiny batch)."""
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    kappa = np.array([[0.0, 1.0, 9.0], [2.0, 9.0, 9.0]], np.float32)
    keys = jax.random.split(jax.random.key(0), 600)
    outs = np.asarray(jax.vmap(lambda k: shuffle_gate(kappa, mask, k))(keys))
    for value in (0.0, 1.0, 2.0):
        freq = (outs[:, mask] == value).mean(axis=0)
        np.testing.assert_allclose(freq, 1 / 3, atol=0.08)
    with pytest.raises(ValueError, match=r"mask has shape \(3, 2\) but kappa has shape \(2, 3\)"):
        shuffle_gate(kappa, mask.T, jax.random.key(0))


@pytest.mark.parametrize("envelope", [(0.1, 0.9, 4.0), (0.3, 0.7, 1.5), (0.0, 1.0, 8.0)])
def test_gate_concentration_inverts_the_retention_gate(envelope):
    lo, hi, tau = envelope
    c = jnp.linspace(0.0, 1.0, 101)
    kappa = retention_gate(c, kappa_lo=lo, kappa_hi=hi, tau=tau)
    np.testing.assert_allclose(gate_concentration(kappa, kappa_lo=lo, kappa_hi=hi, tau=tau), c, atol=2e-4)
    with pytest.raises(ValueError, match="constant envelope"):
        gate_concentration(kappa, kappa_lo=0.5, kappa_hi=0.5)
