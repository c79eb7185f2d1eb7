"""Blockwise kernels (TPU kernel interpreted, Triton kernel interpreted, and compiled on a GPU) against the reference.

fp32: out and H within 1e-5 of the materialized reference, n exact. bf16 inputs: logits and
H are fp32 on both sides, so H keeps the 1e-5 bound; the output is rounded to bf16 and the
probabilities are rounded to bf16 before the PV matmul in a different blockwise order, so out
agrees to a few bf16 ulps (rtol 2^-5, atol 2^-6; measured up to 2 ulps).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comppo_jax import normalized_concentration
from comppo_jax.credit import statistic_concentration
from pallas_kernels import STATISTICS, attention_with_concentration, default_backend, window_sizes
from pallas_kernels.common import round_up
from pallas_kernels.gpu import attention_with_concentration_gpu
from pallas_kernels.tpu import attention_with_concentration_tpu, default_block_sizes

BLOCKWISE = {
    "interpret": functools.partial(attention_with_concentration_tpu, interpret=True),
    "gpu-interpret": functools.partial(attention_with_concentration_gpu, interpret=True),
    "gpu": attention_with_concentration_gpu,  # the Triton kernel compiled: on a GPU only
}
ALL_BACKENDS = {**BLOCKWISE, "reference": functools.partial(attention_with_concentration, backend="reference")}
# Small blocks so L = 45 spans several q and kv blocks and is not a multiple of either.
BLOCKS = dict(block_q=16, block_k=32)
HEADS = [(4, 4), (8, 2), (8, 1)]  # (Hq, Hkv): Hq/Hkv = 1, 4, 8


def jitted(backend, **static):
    """ALL_BACKENDS[backend] with its static keyword arguments, jitted once for the module: tests
    that call it with the same arguments and shapes share one compile (an interpreted kernel's
    compile takes seconds; its run, milliseconds)."""
    return _jitted(backend, tuple(sorted(static.items())))


@functools.cache
def _jitted(backend, static):
    return jax.jit(functools.partial(ALL_BACKENDS[backend], **dict(static)))


def backends(names):
    """`names` as parameters, the compiled GPU kernel marked gpu (skipped off a GPU)."""
    return [pytest.param(name, marks=pytest.mark.gpu) if name == "gpu" else name for name in sorted(names)]


def random_inputs(seed, *, lengths=(45, 30, 17), num_heads=8, num_kv_heads=2, head_dim=16, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    batch, length = len(lengths), max(lengths)
    q = rng.normal(size=(batch, length, num_heads, head_dim)) * 1.5
    k = rng.normal(size=(batch, length, num_kv_heads, head_dim))
    v = rng.normal(size=(batch, length, num_kv_heads, head_dim))
    mask = np.arange(length)[None] < np.asarray(lengths)[:, None]
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + (jnp.asarray(mask),)


def reference(q, k, v, mask, window_start, **kwargs):
    return jitted("reference", **kwargs)(q, k, v, mask, window_start)


@pytest.mark.parametrize("backend", backends(BLOCKWISE))
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("window_start", [(0, 0, 0), (12, 7, 17)])  # full window; prompt lengths
def test_fp32_matches_reference(backend, num_heads, num_kv_heads, window_start):
    q, k, v, mask = random_inputs(0, num_heads=num_heads, num_kv_heads=num_kv_heads)
    window_start = jnp.asarray(window_start, jnp.int32)
    out, herfindahl, window_size = jitted(backend, **BLOCKS)(q, k, v, mask, window_start)
    expected_out, expected_h, expected_n = reference(q, k, v, mask, window_start)
    np.testing.assert_allclose(out, expected_out, atol=1e-5)
    np.testing.assert_allclose(herfindahl, expected_h, atol=1e-5)
    np.testing.assert_array_equal(window_size, expected_n)


@pytest.mark.parametrize("backend", backends(BLOCKWISE))
def test_bf16_within_documented_bounds(backend):
    q, k, v, mask = random_inputs(1, dtype=jnp.bfloat16)
    window_start = jnp.asarray([5, 0, 9], jnp.int32)
    out, herfindahl, window_size = jitted(backend, **BLOCKS)(q, k, v, mask, window_start)
    assert out.dtype == jnp.bfloat16 and herfindahl.dtype == jnp.float32
    expected_out, expected_h, expected_n = reference(q, k, v, mask, window_start)
    np.testing.assert_allclose(out.astype(jnp.float32), expected_out.astype(jnp.float32), rtol=2**-5, atol=2**-6)
    np.testing.assert_allclose(herfindahl, expected_h, atol=1e-5)
    np.testing.assert_array_equal(window_size, expected_n)


def test_default_blocks_and_left_padding_match_reference():
    """Default block sizes (one block here) and a left-padded row, whose leading queries see no key."""
    q, k, v, _ = random_inputs(2, lengths=(40, 40))
    mask = jnp.asarray(np.arange(40)[None] >= np.asarray([0, 6])[:, None])
    window_start = jnp.asarray([3, 10], jnp.int32)
    out, herfindahl, window_size = attention_with_concentration(q, k, v, mask, window_start, backend="interpret")
    expected_out, expected_h, expected_n = reference(q, k, v, mask, window_start)
    np.testing.assert_allclose(out, expected_out, atol=1e-5)
    np.testing.assert_allclose(herfindahl, expected_h, atol=1e-5)
    np.testing.assert_array_equal(window_size, expected_n)


@pytest.mark.parametrize("length", [230, 300, 600, 1100, 16384])
@pytest.mark.parametrize("heads,kv_heads,head_dim,itemsize", [(4, 2, 32, 4), (16, 8, 128, 4), (32, 8, 128, 2)])
@pytest.mark.parametrize("lane_multiple", [8, 128])  # interpret, tpu
def test_default_blocks_pad_a_row_to_less_than_one_key_block(
    length, heads, kv_heads, head_dim, itemsize, lane_multiple
):
    # Blocks clamped to the row apart once padded a 230-token row to lcm(128, 232) = 3712.
    block_q, block_k = default_block_sizes(length, heads, kv_heads, head_dim, itemsize, lane_multiple=lane_multiple)
    padded = round_up(length, math.lcm(block_q, block_k))
    assert block_k % block_q == 0 and padded - length < block_k


def property_lengths(length: int) -> tuple[int, ...]:
    """Rows of `length` and half of it, beside a full row of PROPERTY_LENGTH: every example has the
    shape of `random_inputs`' default rows, so the kernels that test_fp32_matches_reference and
    test_statistics_match_reference compile serve every example while the real lengths vary."""
    return length, max(1, length // 2), PROPERTY_LENGTH


PROPERTY_LENGTH = 45


@settings(max_examples=12, deadline=None)
@given(
    length=st.integers(1, PROPERTY_LENGTH),
    heads=st.sampled_from(HEADS),
    window_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_herfindahl_lies_in_one_over_n_to_one(length, heads, window_fraction, seed):
    q, k, v, mask = random_inputs(seed, lengths=property_lengths(length), num_heads=heads[0], num_kv_heads=heads[1])
    window_start = jnp.asarray([int(window_fraction * length)] * 3, jnp.int32)
    _, herfindahl, window_size = jitted("interpret", **BLOCKS)(q, k, v, mask, window_start)
    h, n = np.asarray(herfindahl, np.float64), np.asarray(window_size)
    has_window = n > 0
    assert (h[has_window] >= 1 / n[has_window] - 1e-6).all() and (h[has_window] <= 1 + 1e-6).all()
    assert (h[~has_window] == 0).all()


# random_inputs' rows (45, 30 and 17 tokens), so the kernels compiled for test_fp32_matches_reference
# (and, with the statistics, test_statistics_match_reference) serve here too.
ONE_HOT_WINDOW_START = (4, 9, 12)


@pytest.mark.parametrize("backend", backends(ALL_BACKENDS))
def test_uniform_attention_gives_c_zero_and_one_hot_gives_c_one(backend):
    q, k, v, mask = random_inputs(3)
    window_start = jnp.asarray(ONE_HOT_WINDOW_START, jnp.int32)
    kernel = jitted(backend, **(BLOCKS if backend in BLOCKWISE else {}))

    # q = 0: every visible key is equally likely, so H = 1/n and c = 0.
    _, herfindahl, n = kernel(jnp.zeros_like(q), k, v, mask, window_start)
    c = normalized_concentration(herfindahl, n)
    np.testing.assert_allclose(np.asarray(c)[np.asarray(n) >= 2], 0.0, atol=1e-5)

    # Every head puts all its mass on the window's first key: H = 1 and c = 1.
    one_hot_key = np.zeros(k.shape, np.float32)
    one_hot_key[np.arange(3), np.asarray(window_start), :, 0] = 30.0
    q_one_hot = jnp.zeros_like(q).at[..., 0].set(30.0)
    _, herfindahl, n = kernel(q_one_hot, jnp.asarray(one_hot_key), v, mask, window_start)
    c = normalized_concentration(herfindahl, n)
    np.testing.assert_allclose(np.asarray(c)[np.asarray(n) >= 2], 1.0, atol=1e-5)


@pytest.mark.parametrize("backend", backends(BLOCKWISE))
def test_log_sum_exp_matches_the_masked_logits(backend):
    q, k, v, mask = random_inputs(6, num_heads=8, num_kv_heads=2)
    *_, lse = jitted(backend, return_lse=True, **BLOCKS)(q, k, v, mask, jnp.zeros((3,), jnp.int32))
    length = q.shape[1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 4, axis=2)) * q.shape[-1] ** -0.5
    visible = jnp.tril(jnp.ones((length, length), bool))[None, None] & mask[:, None, None, :]
    expected = jax.nn.logsumexp(jnp.where(visible, logits, -jnp.inf), axis=-1)
    np.testing.assert_allclose(lse, expected, atol=1e-5)


@pytest.mark.parametrize("backend", backends(BLOCKWISE))
# Each window and sink count (none, the default 4, past most windows) once, bf16 with one of them: the
# statistics are fp32 sums over the same masks whatever the input dtype, which only changes the logits
# (each sink count is a compile).
@pytest.mark.parametrize(
    "dtype, window_start, sink_tokens",
    [(jnp.float32, (0, 0, 0), 0), (jnp.float32, (12, 7, 17), 4), (jnp.bfloat16, (12, 7, 17), 40)],
)
def test_statistics_match_reference(backend, dtype, window_start, sink_tokens):
    """Every statistic at once, through several q and kv blocks; H and n are unchanged by them."""
    q, k, v, mask = random_inputs(7, dtype=dtype)
    window_start = jnp.asarray(window_start, jnp.int32)
    kernel = jitted(backend, statistics=STATISTICS, sink_tokens=sink_tokens, **BLOCKS)
    out, herfindahl, window_size, statistics = kernel(q, k, v, mask, window_start)
    expected_out, expected_h, expected_n, expected = reference(
        q, k, v, mask, window_start, statistics=STATISTICS, sink_tokens=sink_tokens
    )
    np.testing.assert_allclose(herfindahl, expected_h, atol=1e-5)
    np.testing.assert_array_equal(window_size, expected_n)
    assert sorted(statistics) == sorted(STATISTICS)
    for name in STATISTICS:  # entropy is in nats, up to log(45) ~ 3.8
        np.testing.assert_allclose(
            statistics[name], expected[name], atol=1e-5 if name != "entropy" else 4e-5, err_msg=name
        )
    alone = jitted(backend, **BLOCKS)(q, k, v, mask, window_start)
    np.testing.assert_array_equal(np.asarray(alone[1]), np.asarray(herfindahl))


@settings(max_examples=8, deadline=None)
@given(
    length=st.integers(1, PROPERTY_LENGTH),
    window_fraction=st.floats(0.0, 1.0),
    # None and the default 4, as test_statistics_match_reference compiles them (each count is a
    # compile): the sink window is the window shifted by sink_tokens, whose start varies anyway.
    sink_tokens=st.sampled_from([0, 4]),
    seed=st.integers(0, 2**16),
)
def test_statistics_lie_in_their_ranges(length, window_fraction, sink_tokens, seed):
    """0 <= E <= log n, 1/n <= max weight <= 1, 1/n' <= sink H <= 1, and every c in [0, 1]."""
    q, k, v, mask = random_inputs(seed, lengths=property_lengths(length))
    window_start = jnp.asarray([int(window_fraction * length)] * 3, jnp.int32)
    kernel = jitted("interpret", statistics=STATISTICS, sink_tokens=sink_tokens, **BLOCKS)
    _, _, n, statistics = kernel(q, k, v, mask, window_start)
    n = np.asarray(n)
    sink_n = np.asarray(window_sizes(mask, window_start + sink_tokens))
    entropy, peak, sink_h = (
        np.asarray(statistics[name], np.float64) for name in ("entropy", "max_weight", "sink_herfindahl")
    )
    has = n > 0
    assert (entropy[has] >= -1e-5).all() and (entropy[has] <= np.log(n[has]) + 1e-5).all()
    assert (peak[has] >= 1 / n[has] - 1e-6).all() and (peak[has] <= 1 + 1e-6).all()
    assert (sink_h[sink_n > 0] >= 1 / sink_n[sink_n > 0] - 1e-6).all() and (sink_h <= 1 + 1e-6).all()
    assert (entropy[~has] == 0).all() and (peak[~has] == 0).all() and (sink_h[sink_n == 0] == 0).all()
    for name, window in (("entropy", n), ("max_weight", n), ("sink_herfindahl", sink_n)):
        c = np.asarray(statistic_concentration(name, statistics[name], jnp.asarray(window)))
        assert ((c >= 0) & (c <= 1)).all(), name


@pytest.mark.parametrize("backend", backends(ALL_BACKENDS))
def test_every_statistic_maps_uniform_to_zero_and_one_hot_to_one(backend):
    """The endpoints of eq. cnorm hold for each statistic's c (sink-masked: the one-hot key lies past the sinks)."""
    q, k, v, mask = random_inputs(3)
    window_start = jnp.asarray(ONE_HOT_WINDOW_START, jnp.int32)
    sink_tokens = 4
    kernel = jitted(backend, **(BLOCKS if backend in BLOCKWISE else {}), statistics=STATISTICS, sink_tokens=sink_tokens)
    windows = {"entropy": None, "max_weight": None, "sink_herfindahl": window_sizes(mask, window_start + sink_tokens)}

    def concentrations(q, k):
        _, _, n, statistics = kernel(q, k, v, mask, window_start)
        return {
            name: (
                np.asarray(
                    statistic_concentration(name, statistics[name], n if windows[name] is None else windows[name])
                ),
                np.asarray(n if windows[name] is None else windows[name]),
            )
            for name in STATISTICS
        }

    for name, (c, n) in concentrations(jnp.zeros_like(q), k).items():
        np.testing.assert_allclose(c[n >= 2], 0.0, atol=1e-5, err_msg=name)
    one_hot_key = np.zeros(k.shape, np.float32)
    one_hot_key[np.arange(3), np.asarray(window_start) + sink_tokens, :, 0] = 30.0
    for name, (c, n) in concentrations(jnp.zeros_like(q).at[..., 0].set(30.0), jnp.asarray(one_hot_key)).items():
        seen = (
            np.arange(q.shape[1])[None] >= np.asarray(window_start)[:, None] + sink_tokens
        )  # queries that see the one-hot key
        np.testing.assert_allclose(c[(n >= 2) & seen], 1.0, atol=1e-5, err_msg=name)


def test_unknown_statistic_is_named():
    q, k, v, mask = random_inputs(5)
    with pytest.raises(ValueError, match=r"unknown concentration statistic 'renyi'"):
        attention_with_concentration(
            q, k, v, mask, jnp.zeros((3,), jnp.int32), backend="interpret", statistics=("renyi",)
        )


@pytest.mark.parametrize("backend", backends(["interpret", "gpu"]))
def test_kernel_output_is_differentiable_through_xla_attention(backend):
    """The statistics are detached; the output's gradient equals that of plain attention."""
    q, k, v, mask = random_inputs(4, lengths=(20, 13))
    window_start = jnp.asarray([2, 5], jnp.int32)

    def loss(q, k, v, backend):
        out, herfindahl, _ = attention_with_concentration(q, k, v, mask, window_start, backend=backend)
        return jnp.sum(jnp.sin(out)) + jnp.sum(herfindahl)

    kernel_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, backend)

    # The reference differentiates H too; subtract that by differentiating with H stopped.
    def reference_loss(q, k, v):
        out, herfindahl, _ = reference(q, k, v, mask, window_start)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jax.lax.stop_gradient(herfindahl))

    expected = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(kernel_grads, expected):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_default_backend_follows_the_platform():
    assert default_backend() == {"cpu": "interpret", "gpu": "gpu", "tpu": "tpu"}[jax.default_backend()]


def test_bad_block_sizes_are_named():
    q, k, v, mask = random_inputs(5)
    window_start = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match=r"block_k=100 must be a multiple of 128 for the tpu backend"):
        attention_with_concentration(q, k, v, mask, window_start, backend="tpu", block_k=100)
    with pytest.raises(ValueError, match=r"block_q=12 must be a multiple of 8 for the interpret backend"):
        attention_with_concentration(q, k, v, mask, window_start, backend="interpret", block_q=12)
    with pytest.raises(ValueError, match=r"block_q=48 must be a power of two >= 16 for the gpu backend"):
        attention_with_concentration(q, k, v, mask, window_start, backend="gpu", block_q=48)
