"""`packed_flash_attention` (Mosaic forward + backward with the segment block skip) against the
XLA oracle `causal_attention`, interpreted on CPU; the visited block pairs against a brute-force
count; and an ahead-of-time TPU compile (libtpu) of the forward and backward at Qwen3-4B shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tpu_devices

from comppo_jax.models import preset_model_config
from pallas_kernels.common import causal_attention, round_up
from pallas_kernels.packed_attention import (
    block_bounds,
    packed_flash_attention,
    packed_inputs,
    visited_block_pairs,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
# (block_q, block_k): several blocks per row, segment edges inside and across blocks, bq < bk and bq > bk.
BLOCKS = [(16, 32), (32, 16)]


def packed_rows():
    """Two packed rows of 136 tokens: (mask, segment_ids). Row 0: sequences of 20, 13 and 9 tokens
    with 5 tokens of padding (segment 0) between the first two and padding after; row 1: 37, 60
    (spanning several key blocks) and 33 tokens, then 6 of padding."""
    length = 136
    segments = np.zeros((2, length), np.int32)
    offset = 0
    for s, (n, gap) in enumerate([(20, 5), (13, 0), (9, 0)]):
        segments[0, offset : offset + n] = s + 1
        offset += n + gap
    offset = 0
    for s, n in enumerate([37, 60, 33]):
        segments[1, offset : offset + n] = s + 4
        offset += n
    return jnp.asarray(segments > 0), jnp.asarray(segments)


def left_padded_rows():
    """One sequence per row (segment_ids None), left padded by 10 and 40 of 72 tokens: (mask, None)."""
    length = 72
    return jnp.asarray(np.arange(length)[None] >= np.asarray([10, 40])[:, None]), None


CASES = {"packed": packed_rows, "left-padded": left_padded_rows}


def random_qkv(seed, length, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    make = lambda heads: jnp.asarray(rng.normal(size=(2, length, heads, HEAD_DIM)), dtype)
    return make(NUM_HEADS) * 1.5, make(NUM_KV_HEADS), make(NUM_KV_HEADS)


def oracle(mask, segment_ids):
    return lambda q, k, v: causal_attention(q, k, v, mask, segment_ids=segment_ids)


@functools.cache
def interpreted(case, blocks):
    """(mask, segment_ids, (q, k, v), cotangent, out, (dq, dk, dv)): the kernel's output and its VJP of
    a random cotangent over the real queries, from one compiled program (the forward kernel's, which
    the gradient runs too), shared by the forward and gradient tests."""
    mask, segment_ids = CASES[case]()
    q, k, v = random_qkv(1, mask.shape[1])
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32) * mask[:, :, None, None]
    attention = lambda q, k, v: packed_flash_attention(
        q, k, v, mask, segment_ids, block_q=blocks[0], block_k=blocks[1], interpret=True
    )

    def out_and_grads(q, k, v):
        out, pullback = jax.vjp(attention, q, k, v)
        return out, pullback(cotangent)

    return (mask, segment_ids, (q, k, v), cotangent, *jax.jit(out_and_grads)(q, k, v))


@pytest.mark.parametrize("blocks", [BLOCKS[0], pytest.param(BLOCKS[1], marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_the_oracle_at_every_real_query(case, blocks):
    mask, segment_ids, (q, k, v), _, out, _ = interpreted(case, blocks)
    expected = jax.jit(oracle(mask, segment_ids))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(expected)[real], atol=1e-5)
    assert np.all(np.asarray(out)[~real & (np.cumsum(real, axis=1) == 0)] == 0)  # sees no key: 0


@pytest.mark.parametrize("blocks", [BLOCKS[0], pytest.param(BLOCKS[1], marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_the_oracle(case, blocks):
    mask, segment_ids, (q, k, v), cotangent, _, got = interpreted(case, blocks)
    loss = lambda q, k, v: jnp.sum(oracle(mask, segment_ids)(q, k, v) * cotangent)  # over the real queries only
    expected = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", got, expected):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), f"d{name}"


@pytest.mark.slow
def test_bf16_forward_and_gradients_within_bf16_rounding():
    mask, segment_ids = packed_rows()
    q, k, v = random_qkv(3, mask.shape[1], jnp.bfloat16)
    f = lambda q, k, v: packed_flash_attention(q, k, v, mask, segment_ids, block_q=16, block_k=32, interpret=True)
    loss = lambda attention: lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)
    out, grads = jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    upcast = [x.astype(jnp.float32) for x in (q, k, v)]
    expected_out = oracle(mask, segment_ids)(*upcast)
    expected_grads = jax.grad(loss(oracle(mask, segment_ids)), argnums=(0, 1, 2))(*upcast)
    real = np.asarray(mask)
    np.testing.assert_allclose(
        np.asarray(out.astype(jnp.float32))[real], np.asarray(expected_out)[real], rtol=2**-5, atol=2**-6
    )
    for a, b in zip(grads, expected_grads):
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 2**-5 * np.max(np.abs(b))


# --- The skip -------------------------------------------------------------------------------------


def brute_force_pairs(segment_ids, mask, length, block_q, block_k, *, with_key_mask):
    """[B, nq, nk] bool: the block pairs holding a query p and key i <= p of the same contiguous run
    (and, with_key_mask, a real key), by enumeration over the padded row (positions past L extend
    the row's last run, as the kernels' layout does; their keys are padding)."""
    padded = round_up(length, np.lcm(block_q, block_k))
    segment_ids = np.pad(np.asarray(segment_ids), ((0, 0), (0, padded - length)), mode="edge")
    real = np.pad(np.asarray(mask), ((0, 0), (0, padded - length)))
    runs = np.concatenate([np.zeros_like(segment_ids[:, :1]), np.cumsum(np.diff(segment_ids, axis=1) != 0, 1)], 1)
    positions = np.arange(padded)
    pairs = np.zeros((len(segment_ids), padded // block_q, padded // block_k), bool)
    for b in range(len(segment_ids)):
        sees = (positions[None, :] <= positions[:, None]) & (runs[b][:, None] == runs[b][None, :])
        if with_key_mask:
            sees &= real[b][None, :]
        query, key = np.nonzero(sees)
        pairs[b, query // block_q, key // block_k] = True
    return pairs


def kernel_pairs(mask, segment_ids, block_q, block_k):
    return [np.asarray(x) for x in _kernel_pairs(mask, segment_ids, block_q, block_k)]


@functools.partial(jax.jit, static_argnums=(2, 3))  # one compile per layout, not one per op of it
def _kernel_pairs(mask, segment_ids, block_q, block_k):
    padded = round_up(mask.shape[1], np.lcm(block_q, block_k))
    query_starts, _ = packed_inputs(mask, segment_ids, padded)
    first_kv_block, last_q_block = block_bounds(query_starts, block_q, block_k)
    return visited_block_pairs(first_kv_block, last_q_block, block_q, block_k)


def random_layouts(seed, rows=4, length=200):
    """Rows of random contiguous runs (some of them padding, segment 0) of 1 to 70 tokens."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, length), np.int32)
    for r in range(rows):
        offset, s = 0, 1
        while offset < length:
            n = int(rng.integers(1, 71))
            segments[r, offset : offset + n] = 0 if rng.random() < 0.2 else s
            offset, s = offset + n, s + 1
    return jnp.asarray(segments > 0), jnp.asarray(segments)


@pytest.mark.parametrize(
    "blocks", BLOCKS + [pytest.param(blocks, marks=pytest.mark.slow) for blocks in ((16, 16), (24, 40))]
)
@pytest.mark.parametrize("case", sorted(CASES) + ["random"])
def test_visited_block_pairs_are_exactly_those_with_a_visible_pair(case, blocks):
    mask, segment_ids = random_layouts(4) if case == "random" else CASES[case]()
    segments = np.zeros(mask.shape, np.int32) if segment_ids is None else np.asarray(segment_ids)
    forward, dkdv = kernel_pairs(mask, segment_ids, *blocks)
    structural = brute_force_pairs(segments, mask, mask.shape[1], *blocks, with_key_mask=False)
    needed = brute_force_pairs(segments, mask, mask.shape[1], *blocks, with_key_mask=True)
    np.testing.assert_array_equal(forward, structural)  # forward and dq
    np.testing.assert_array_equal(dkdv, structural)
    assert np.all(forward >= needed)  # every block pair with a visible (q, k) pair is computed
    if case != "left-padded":  # one segment per row: only the causal skip
        num_q_blocks, num_kv_blocks = forward.shape[1:]
        causal = [(j * blocks[1]) <= (i + 1) * blocks[0] - 1 for i in range(num_q_blocks) for j in range(num_kv_blocks)]
        assert forward.sum() < 0.8 * len(mask) * sum(causal)


def test_packed_rows_cost_about_their_sequences_alone():
    """Row 1 of `packed_rows` (37 + 60 + 33 tokens, blocks of 16): the kernels visit 25 of its 45
    causal block pairs; its sequences alone in rows of their own need 6 + 10 + 6 = 22, and the two
    q blocks that straddle a boundary (2 and 6) add the 3 more."""
    mask, segment_ids = packed_rows()
    forward, dkdv = kernel_pairs(mask, segment_ids, 16, 16)
    alone = sum(-(-n // 16) * (-(-n // 16) + 1) // 2 for n in (37, 60, 33))
    assert (alone, forward[1].sum(), dkdv[1].sum(), 9 * 10 // 2) == (22, 25, 25, 45)


def test_bad_block_sizes_are_named():
    mask, segment_ids = packed_rows()
    q, k, v = random_qkv(0, mask.shape[1])
    with pytest.raises(ValueError, match="block_q=12 must be a positive multiple of 8"):
        packed_flash_attention(q, k, v, mask, segment_ids, block_q=12, block_k=16, interpret=True)
    with pytest.raises(ValueError, match="block_k=64 must be a positive multiple of 128 for the tpu"):
        packed_flash_attention(q, k, v, mask, segment_ids, block_q=128, block_k=64)
    with pytest.raises(ValueError, match="block_k=0"):
        packed_flash_attention(q, k, v, mask, segment_ids, block_q=16, block_k=0, interpret=True)


# --- TPU ahead-of-time compile (libtpu) ------------------------------------------------------------


def test_tpu_forward_and_backward_compile_at_qwen3_4b_training_shapes():
    """L = 4096, B = 1 per device, bf16, default (512) blocks, on v5e: the gradient program holds the
    three Mosaic kernels (forward, dq, dk/dv) and no XLA attention, and the forward program the
    forward kernel alone."""
    devices = tpu_devices("v5e")  # skips without libtpu (fails with COMPPO_REQUIRE_LIBTPU=1)
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    config = preset_model_config("qwen3_4b")
    length, shape = 4096, lambda heads: (1, 4096, heads, config.head_dim)
    inputs = (
        jax.ShapeDtypeStruct(shape(config.num_heads), jnp.bfloat16),
        jax.ShapeDtypeStruct(shape(config.num_kv_heads), jnp.bfloat16),
        jax.ShapeDtypeStruct(shape(config.num_kv_heads), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, length), jnp.bool_),
        jax.ShapeDtypeStruct((1, length), jnp.int32),
    )
    loss = lambda *args: jnp.sum(packed_flash_attention(*args).astype(jnp.float32) ** 2)
    kernels = ["packed_flash_attention_forward", "packed_flash_attention_dq", "packed_flash_attention_dkdv"]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        # Lowered only: its kernel is the same call at the same shapes as the gradient program's forward
        # kernel, which the compile below compiles (each compile takes seconds).
        forward = jax.jit(packed_flash_attention, in_shardings=replicated).trace(*inputs).lower().as_text()
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=replicated)
        compiled = grad.trace(*inputs).lower().compile()
    assert forward.count("tpu_custom_call") == 1 and kernels[0] in forward
    text = compiled.as_text()
    assert text.count("tpu_custom_call") == len(kernels)
    assert all(name in text for name in kernels), [name for name in kernels if name not in text]
    assert compiled.memory_analysis() is not None
