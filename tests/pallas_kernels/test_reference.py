"""The materialized reference backend against a per-head NumPy loop; input errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_with_concentration

# Jitted: one compile per shape and statistics, where op by op each new shape compiles every op.
reference = jax.jit(
    functools.partial(attention_with_concentration, backend="reference"), static_argnames=("statistics", "sink_tokens")
)


def numpy_attention(q, k, v, mask, window_start, scale, sink_tokens=4):
    """(out, herfindahl, window_size, {statistic: value}) by a loop over rows, queries and heads."""
    batch, length, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    out = np.zeros_like(q)
    herfindahl = np.zeros((batch, length))
    window_size = np.zeros((batch, length), np.int64)
    statistics = {name: np.zeros((batch, length)) for name in ("entropy", "sink_herfindahl", "max_weight")}
    for b in range(batch):
        for p in range(length):
            keys = [i for i in range(p + 1) if mask[b, i]]
            head_probs = []
            for h in range(num_heads):
                logits = np.array([q[b, p, h] @ k[b, i, h // group] for i in keys]) * scale
                probs = np.exp(logits - logits.max())
                probs /= probs.sum()
                head_probs.append(probs)
                out[b, p, h] = probs @ v[b, keys, h // group]
            mean = np.mean(head_probs, axis=0)
            window = [j for j, i in enumerate(keys) if i >= window_start[b]]
            if window:
                weights = mean[window] / mean[window].sum()
                herfindahl[b, p] = np.square(weights).sum()
                window_size[b, p] = len(window)
                statistics["entropy"][b, p] = -np.sum(weights * np.log(weights))
                statistics["max_weight"][b, p] = weights.max()
            beyond_sinks = [j for j, i in enumerate(keys) if i >= window_start[b] + sink_tokens]
            if beyond_sinks:
                weights = mean[beyond_sinks] / mean[beyond_sinks].sum()
                statistics["sink_herfindahl"][b, p] = np.square(weights).sum()
    return out, herfindahl, window_size, statistics


def random_inputs(seed, batch=2, length=11, num_heads=4, num_kv_heads=2, head_dim=8, lengths=(11, 6)):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, num_heads, head_dim)).astype(np.float32) * 1.5
    k = rng.normal(size=(batch, length, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, length, num_kv_heads, head_dim)).astype(np.float32)
    mask = np.arange(length)[None] < np.asarray(lengths)[:, None]
    return q, k, v, mask


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("window_start", [(0, 0), (4, 2)])
def test_reference_matches_numpy_loop(num_heads, num_kv_heads, window_start):
    q, k, v, mask = random_inputs(0, num_heads=num_heads, num_kv_heads=num_kv_heads)
    window_start = np.asarray(window_start, np.int32)
    out, herfindahl, window_size = reference(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), jnp.asarray(window_start)
    )
    expected_out, expected_h, expected_n, _ = numpy_attention(q, k, v, mask, window_start, 8**-0.5)
    np.testing.assert_allclose(np.asarray(out)[mask], expected_out[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(herfindahl)[mask], expected_h[mask], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(window_size)[mask], expected_n[mask])


@pytest.mark.parametrize("sink_tokens", [0, 2, 4])
@pytest.mark.parametrize("window_start", [(0, 0), (4, 2)])
def test_reference_statistics_match_numpy_loop(window_start, sink_tokens):
    q, k, v, mask = random_inputs(1, num_heads=8, num_kv_heads=2)
    window_start = np.asarray(window_start, np.int32)
    *_, statistics = reference(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(mask),
        jnp.asarray(window_start),
        statistics=("entropy", "sink_herfindahl", "max_weight"),
        sink_tokens=sink_tokens,
    )
    *_, expected = numpy_attention(q, k, v, mask, window_start, 8**-0.5, sink_tokens)
    assert sorted(statistics) == sorted(expected)
    for name, value in statistics.items():
        np.testing.assert_allclose(np.asarray(value)[mask], expected[name][mask], atol=2e-6, err_msg=name)


def test_bad_inputs_name_the_tensor():
    q, k, v, mask = random_inputs(2)
    ws = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"k must be \[B, L, Hkv, D\]"):
        attention_with_concentration(jnp.asarray(q), jnp.asarray(k[:, :5]), jnp.asarray(v), jnp.asarray(mask), ws)
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k/v heads \(3\)"):
        k3 = np.concatenate([k, k[:, :, :1]], axis=2)
        attention_with_concentration(jnp.asarray(q), jnp.asarray(k3), jnp.asarray(k3), jnp.asarray(mask), ws)
    with pytest.raises(ValueError, match=r"attention_mask must be bool"):
        attention_with_concentration(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask, jnp.int32), ws)
    with pytest.raises(ValueError, match=r"backend='cuda' is not available"):
        attention_with_concentration(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), ws, backend="cuda"
        )
