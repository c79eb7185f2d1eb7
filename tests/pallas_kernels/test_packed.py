"""Packed rows (several sequences per row, `segment_ids`): every backend gives each token what it
gets with its sequence alone in a row of its own (the reference on the unpacked rows)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import STATISTICS, attention_with_concentration
from pallas_kernels.common import segment_starts
from pallas_kernels.gpu import attention_with_concentration_gpu
from pallas_kernels.tpu import attention_with_concentration_tpu

BACKENDS = {
    "reference": functools.partial(attention_with_concentration, backend="reference"),
    "interpret": functools.partial(attention_with_concentration_tpu, interpret=True, block_q=16, block_k=32),
    "gpu-interpret": functools.partial(attention_with_concentration_gpu, interpret=True, block_q=16, block_k=32),
}
# Jitted once for the module, with every output: both window cases share a backend's compile (seconds,
# where an interpreted run takes milliseconds), and every test's reference on the unpacked rows one.
WITH_EVERY_OUTPUT = {
    name: jax.jit(functools.partial(run, return_lse=True, statistics=STATISTICS)) for name, run in BACKENDS.items()
}
# (length, prompt length) of each sequence, and the packed row each goes to: rows of 72 tokens hold
# 3 + 2 sequences, the first row with padding between nothing and its end, the second with a
# sequence that spans several key blocks after one that ends inside a block.
SEQUENCES = [(20, 6), (13, 13), (9, 4), (37, 10), (33, 0)]
ROWS = [[0, 1, 2], [3, 4]]
ROW_LENGTH = 72


def sequences(seed, num_heads=8, num_kv_heads=2, head_dim=16):
    rng = np.random.default_rng(seed)
    make = lambda n, h: rng.normal(size=(n, h, head_dim)).astype(np.float32)
    return [(make(n, num_heads) * 1.5, make(n, num_kv_heads), make(n, num_kv_heads)) for n, _ in SEQUENCES]


def padded(parts):
    """Each sequence alone in a row: (q, k, v, mask, window_start [B])."""
    length = max(n for n, _ in SEQUENCES)
    rows = [[np.pad(x, ((0, length - len(x)), (0, 0), (0, 0))) for x in part] for part in parts]
    q, k, v = (jnp.asarray(np.stack([row[i] for row in rows])) for i in range(3))
    mask = jnp.asarray(np.arange(length)[None] < np.asarray([n for n, _ in SEQUENCES])[:, None])
    return q, k, v, mask, jnp.asarray([p for _, p in SEQUENCES], jnp.int32)


def packed(parts, window):
    """The sequences packed into ROWS: (q, k, v, mask, window_start [R, S], segment_ids, where [(row, offset)])."""
    shape = lambda h: (len(ROWS), ROW_LENGTH, h, parts[0][0].shape[-1])
    q, k, v = (
        np.zeros(shape(parts[0][0].shape[1]), np.float32),
        *(np.zeros(shape(parts[0][1].shape[1]), np.float32),) * 2,
    )
    k, v = k.copy(), v.copy()
    segments = np.zeros((len(ROWS), ROW_LENGTH), np.int32)
    window_start = np.zeros((len(ROWS), ROW_LENGTH), np.int32)
    where = [None] * len(SEQUENCES)
    for r, members in enumerate(ROWS):
        offset = 0
        for s in members:
            n, prompt = SEQUENCES[s]
            for target, source in zip((q, k, v), parts[s]):
                target[r, offset : offset + n] = source
            segments[r, offset : offset + n] = s + 1
            window_start[r, offset : offset + n] = offset + (prompt if window == "response" else 0)
            where[s] = (r, offset)
            offset += n
    mask = segments > 0
    arrays = (jnp.asarray(x) for x in (q, k, v, mask, window_start, segments))
    return (*arrays, where)


def unpacked(x, where, length):
    """[R, S, ...] (or [R, H, S] lse) -> [B, length, ...] at each sequence's tokens (0 past its end)."""
    x = np.asarray(x)
    out = np.zeros((len(where), length) + x.shape[2:], x.dtype)
    for s, (r, offset) in enumerate(where):
        n = SEQUENCES[s][0]
        out[s, :n] = x[r, offset : offset + n]
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("window", ["response", "full"])
def test_packed_rows_match_each_sequence_alone(backend, window):
    parts = sequences(0)
    q, k, v, mask, window_start, segment_ids, where = packed(parts, window)
    pq, pk, pv, pmask, prompt = padded(parts)
    alone_start = prompt if window == "response" else jnp.zeros_like(prompt)
    run = WITH_EVERY_OUTPUT[backend]
    out, herfindahl, size, lse, statistics = run(q, k, v, mask, window_start, segment_ids=segment_ids)
    e_out, e_h, e_n, e_lse, e_statistics = WITH_EVERY_OUTPUT["reference"](pq, pk, pv, pmask, alone_start)
    length = pq.shape[1]
    real = np.asarray(pmask)
    back = lambda x: unpacked(x, where, length)
    np.testing.assert_allclose(back(out)[real], np.asarray(e_out)[real], atol=1e-5)
    np.testing.assert_allclose(back(herfindahl)[real], np.asarray(e_h)[real], atol=1e-5)
    np.testing.assert_array_equal(back(size)[real], np.asarray(e_n)[real])
    np.testing.assert_allclose(
        back(np.moveaxis(np.asarray(lse), 1, 2))[real], np.moveaxis(np.asarray(e_lse), 1, 2)[real], atol=1e-5
    )
    for name in STATISTICS:
        np.testing.assert_allclose(back(statistics[name])[real], np.asarray(e_statistics[name])[real], atol=1e-5)


def test_packed_output_gradient_stays_in_its_segment():
    """The kernel output's gradient (XLA attention with the same segments) of one sequence's tokens
    reaches no other sequence's q, k or v."""
    parts = sequences(1)
    q, k, v, mask, window_start, segment_ids, where = packed(parts, "response")

    def first_sequence_output(q, k, v):
        out = attention_with_concentration(q, k, v, mask, window_start, backend="interpret", segment_ids=segment_ids)[0]
        return jnp.sum(jnp.where((segment_ids == 1)[..., None, None], out, 0.0) ** 2)

    grads = jax.jit(jax.grad(first_sequence_output, argnums=(0, 1, 2)))(q, k, v)
    others = np.asarray(segment_ids) != 1
    for grad in grads:
        assert np.all(np.asarray(grad)[others] == 0.0)
        assert np.any(np.asarray(grad)[~others] != 0.0)


def test_segment_starts_of_contiguous_runs():
    segments = jnp.asarray([[1, 1, 2, 2, 2, 0, 0], [3, 3, 3, 3, 4, 4, 5]])
    np.testing.assert_array_equal(segment_starts(segments), [[0, 0, 2, 2, 2, 5, 5], [0, 0, 0, 0, 4, 4, 6]])
