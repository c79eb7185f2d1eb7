"""8-bit rollouts: the KV cache's int8 / float8 pages with their per-token, per-head scales, read by
every decode backend, and the sampler's int8 weights, through `generate` and the run's config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rollout.test_engine import GPU_CONFIG, PROMPT_MASK, PROMPTS, assert_same_generation

from comppo_jax.models import init_params, paged_cache
from comppo_jax.models.quantize import LARGEST, quantize, sampler_weights
from comppo_jax.rollout import engine, generate

EIGHT_BIT = ("int8", "float8_e4m3fn")
CONFIG = GPU_CONFIG  # the GPU kernel's dots need 16 features


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)


# --- pages and decode attention ---------------------------------------------------------------

PAGE, PAGES_PER_LAYER, NUM_KV, NUM_HEADS, HEAD_DIM = 8, 24, 2, 8, 128  # the TPU kernel: hd % 128 == 0
LENGTHS = np.asarray([1, 8, 9, 30, 32], np.int32)  # one token, page boundaries, a partial last page


def written_pool(dtype, backend, seed=0):
    """A two-layer pool whose layer 1 holds keys and values (scaled unevenly per token and head)
    for the rows of LENGTHS, written a token at a time as the engine does; also returns the float
    keys and values [rows, tokens, Hkv, hd], the tables and queries."""
    rng = np.random.default_rng(seed)
    width = -(-LENGTHS.max() // PAGE)
    # Each row its own pages, out of order.
    tables = rng.permutation(np.arange(1, PAGES_PER_LAYER))[: len(LENGTHS) * width].reshape(-1, width).astype(np.int32)
    spread = np.exp(0.5 * rng.normal(size=(len(LENGTHS), LENGTHS.max(), NUM_KV, 1)))  # per-token, per-head magnitudes
    k, v = (rng.normal(size=(len(LENGTHS), LENGTHS.max(), NUM_KV, HEAD_DIM)) * spread for _ in range(2))
    pool = paged_cache.empty_pool(2, PAGES_PER_LAYER, PAGE, NUM_KV, HEAD_DIM, dtype, backend)
    write = jax.jit(paged_cache.write_tokens, static_argnums=1)  # jitted, as in the engine: compiled once
    for t in range(LENGTHS.max()):
        pages = jnp.asarray(np.where(t < LENGTHS, tables[:, t // PAGE], 0))  # rows past their length: trash page 0
        offsets = jnp.full((len(LENGTHS),), t % PAGE, jnp.int32)
        pool = write(pool, 1, pages, offsets, jnp.asarray(k[:, t]), jnp.asarray(v[:, t]))
    q = rng.normal(size=(len(LENGTHS), NUM_HEADS, HEAD_DIM)).astype(np.float32)
    return pool, k, v, tables, q


def dequantized(x, dtype):
    stored, scale = quantize(jnp.asarray(x, jnp.float32), dtype, axis=-1)
    return np.asarray(stored.astype(jnp.float32) * scale[..., None], np.float64)


def oracle(q, k, v):
    """float64 attention of each row's query over its first LENGTHS keys and values."""
    out = np.zeros(q.shape, np.float64)
    group = NUM_HEADS // NUM_KV
    for row, length in enumerate(LENGTHS):
        for head in range(NUM_HEADS):
            keys, values = k[row, :length, head // group], v[row, :length, head // group]
            logits = keys @ q[row, head] / np.sqrt(HEAD_DIM)
            probs = np.exp(logits - logits.max())
            out[row, head] = probs @ values / probs.sum()
    return out


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_a_token_is_stored_within_half_a_step_of_its_scale(dtype):
    x = np.random.default_rng(1).normal(size=(6, 3, 64)) * np.asarray([1e-3, 1.0, 50.0])[:, None]
    stored, scale = quantize(jnp.asarray(x), dtype, axis=-1)
    assert stored.dtype == jnp.dtype(dtype) and scale.shape == (6, 3)
    np.testing.assert_allclose(np.asarray(scale), np.abs(x).max(-1) / LARGEST[dtype], rtol=1e-6)
    error = np.abs(dequantized(x, dtype) - x) / np.asarray(scale)[..., None]
    if dtype == "int8":
        assert error.max() <= 0.5 + 1e-4
    else:  # e4m3: 3 mantissa bits, relative to the value itself
        assert (np.abs(dequantized(x, dtype) - x) <= np.abs(x) / 16 + 1e-6 * np.asarray(scale)[..., None]).all()
    zeros, zero_scale = quantize(jnp.zeros((2, 8)), dtype, axis=-1)
    assert np.all(np.asarray(zeros.astype(jnp.float32)) == 0) and np.all(np.asarray(zero_scale) == 1)


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize(
    "backend", ["xla", "gpu_interpret", "tpu_interpret", pytest.param("gpu", marks=pytest.mark.gpu)]
)
def test_8bit_decode_attention_equals_attention_over_the_stored_values(dtype, backend):
    """Every backend reads the 8-bit pages and their scales as the dequantized keys and values."""
    pool, k, v, tables, q = written_pool(dtype, backend)
    assert pool.quantized == dtype and [a.dtype for a in pool.arrays] == [jnp.dtype(dtype)] * 2
    pages = 2 * PAGES_PER_LAYER
    scales = [(NUM_KV, pages, PAGE)] * 2 if backend.startswith("gpu") else [(pages, NUM_KV * 2 * PAGE)]
    assert [s.shape for s in pool.scales] == scales
    out = paged_cache.decode_attention(
        jnp.asarray(q), pool, 1, jnp.asarray(tables), jnp.asarray(LENGTHS), backend=backend
    )
    np.testing.assert_allclose(
        np.asarray(out), oracle(q, dequantized(k, dtype), dequantized(v, dtype)), rtol=1e-5, atol=1e-5
    )
    # ... and the stored values are an approximation of the written ones, not something else.
    np.testing.assert_allclose(np.asarray(out), oracle(q, k, v), atol={"int8": 0.15, "float8_e4m3fn": 0.6}[dtype])


def test_8bit_pages_take_half_the_bytes_and_the_engine_counts_them():
    layout = engine.make_layout(4, 100, num_samples=4, max_new_tokens=1000, page_size=64, decode_slots=None, shards=1)
    config = CONFIG.replace(head_dim=128, dtype="bfloat16")
    sizes = {}
    for kv_dtype in ("auto", "int8", "float8_e4m3fn"):
        pool = jax.eval_shape(
            lambda: paged_cache.empty_pool(
                config.num_layers,
                layout.pages_per_layer,
                layout.page_size,
                config.num_kv_heads,
                config.head_dim,
                paged_cache.kv_dtype(kv_dtype, config.dtype),
                "xla",
            )
        )
        sizes[kv_dtype] = sum(a.size * a.dtype.itemsize for a in pool.arrays + pool.scales)
        assert engine.pool_bytes(config, layout, kv_dtype) == sizes[kv_dtype]
    # A token's key in one head: 128 bytes and a 4-byte scale, against 256 bytes.
    assert sizes["int8"] / sizes["auto"] == sizes["float8_e4m3fn"] / sizes["auto"] == (128 + 4) / 256
    # ... so at a given budget the engine holds about twice the rows in flight.
    budget = sizes["auto"]
    rows = {name: engine.rows_in_flight(layout, size, budget) for name, size in sizes.items()}
    assert rows["auto"] == layout.slots == 16 and rows["int8"] == rows["float8_e4m3fn"] >= int(1.9 * 16)


# --- the engine -------------------------------------------------------------------------------

GREEDY = dict(max_new_tokens=6, temperature=0.0, num_samples=2)
SAMPLED = dict(max_new_tokens=6, temperature=1.0, num_samples=2)
WAITING = dict(page_size=3, decode_slots=3)  # prompt pages copied on write, rows waiting for slots


@pytest.mark.parametrize("dtype", ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.slow)])
def test_8bit_rows_depend_on_the_rng_only_not_on_pages_slots_or_backend(params, dtype):
    """Per-token scales make a token's stored key independent of its neighbours: page size 1
    (no page is ever shared part-filled) and page size 3 (prompt pages copied on write, with
    their scales), all slots or fewer, the XLA path or the GPU kernel: the same rows."""
    run = lambda **kw: generate(params, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(3), kv_dtype=dtype, **kw)
    reference = run(**SAMPLED, page_size=1, paged_attention="xla")
    for kwargs in (WAITING, dict(page_size=3, paged_attention="gpu_interpret")):
        assert_same_generation(run(**SAMPLED, **kwargs), reference)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_8bit_rows_on_the_gpu_kernel_equal_the_xla_path(params, dtype):
    run = lambda backend: generate(
        params,
        CONFIG,
        PROMPTS,
        PROMPT_MASK,
        jax.random.PRNGKey(3),
        kv_dtype=dtype,
        paged_attention=backend,
        page_size=4,
        **GREEDY,
    )
    assert_same_generation(run("gpu"), run("xla"))


def test_8bit_rollouts_move_the_log_probs_by_a_little(params):
    """The options are in effect (the log-probs move) and 8 bits stay close to the float sampler. (Sampled
    with one key: the int8 pages' sampler is the one the test above compiled.)"""
    run = lambda weights, kv_dtype: generate(
        weights, CONFIG, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(0), kv_dtype=kv_dtype, **SAMPLED, **WAITING
    )
    full = run(params, "auto")
    for kv_dtype, weight_dtype, bound in (("int8", "auto", 0.1), ("auto", "int8", 0.2), ("int8", "int8", 0.2)):
        out = run(sampler_weights(params, weight_dtype, CONFIG.dtype), kv_dtype)
        same = np.asarray(out.response_tokens == full.response_tokens).all(axis=1)  # the rows both decoded alike
        delta = np.abs(np.asarray(out.log_probs - full.log_probs))[same]
        assert same.any() and 1e-4 < delta.max() < bound, (kv_dtype, weight_dtype, delta.max())
