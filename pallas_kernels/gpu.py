"""Triton (GPU) kernels: blockwise causal GQA attention with LSE, then the exact concentration.

Two `pallas_call`s over the caller's [B, L, H, D] layout (no transposes):

1. `_attention_kernel`, grid (q block, batch, q head): FlashAttention-2 forward with fp32
   online softmax; writes the output and the per-head log-sum-exp [B, Hq, L] (fp32).
2. `_concentration_kernel`, grid (q block, batch): for each kv block that meets the window
   [window_start, p] and the causal range, recomputes p_hi = exp(s_hi - lse_h) for every query
   head, sums over heads, and accumulates sum_i a_i and sum_i a_i^2 over the window keys; then
   H = (sum a^2) / (sum a)^2 (paper eq. herfindahl, renormalized over the window), and the
   optional statistics (`pallas_kernels.common.STATISTICS`) from a few more running sums.

Packed rows (`segment_ids`): a query sees only its own segment's keys and reads its own window
start; each q block starts its key loop at its queries' earliest segment start (kernel 1) or
window start (kernel 2), so a packed row costs about what its sequences cost alone.

The largest live arrays are [block_q, block_k] tiles, so nothing of size [L, L] exists. Triton
needs power-of-two tiles: block sizes and the head dim must be powers of two (>= 16 for dot).
Compiler parameters are explicit (`pltriton.CompilerParams`) so the Triton lowering is used.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import (
    DEFAULT_SINK_TOKENS,
    MASK_VALUE,
    ConcentrationOutputs,
    check_attention_inputs,
    check_statistics,
    finish_statistics,
    merge_partials,
    partial_names,
    query_window_start,
    round_up,
    row_segments,
    segment_starts,
    window_partials,
    window_sizes,
)


def _is_power_of_two(value: int) -> bool:
    return value >= 16 and value & (value - 1) == 0


def _attention_kernel(
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    v_ref: jax.Ref,
    key_mask_ref: jax.Ref,
    segment_ref: jax.Ref,  # (padded,) int32: every key's segment
    query_segment_ref: jax.Ref,  # (bq,) int32
    query_first_key_ref: jax.Ref,  # (bq,) int32: each query's segment start
    out_ref: jax.Ref,
    lse_ref: jax.Ref,
    *,
    sm_scale: float,
    block_q: int,
    block_k: int,
    allow_tf32: bool,
) -> None:
    q_block = pl.program_id(0)
    q = q_ref[...]  # (bq, D)
    q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    query_segment = query_segment_ref[...][:, None]

    def kv_step(kv_block: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        acc, running_max, running_sum = carry
        keys = pl.ds(kv_block * block_k, block_k)
        k_pos = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        visible = (k_pos <= q_pos) & (key_mask_ref[keys][None, :] != 0) & (segment_ref[keys][None, :] == query_segment)
        scores = pltriton.dot(q, k_ref[keys, :], trans_b=True, allow_tf32=allow_tf32) * sm_scale
        scores = jnp.where(visible, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))
        rescale = jnp.exp(running_max - new_max)
        probs = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
        values = pltriton.dot(probs.astype(v_ref.dtype), v_ref[keys, :], allow_tf32=allow_tf32)
        return rescale[:, None] * acc + values, new_max, rescale * running_sum + jnp.sum(probs, axis=1)

    num_kv_blocks = lax.div((q_block + 1) * block_q + block_k - 1, block_k)  # causal upper bound
    first = lax.div(jnp.min(query_first_key_ref[...]), block_k)  # keys before the block's segments: never seen
    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, running_max, running_sum = lax.fori_loop(jnp.minimum(first, num_kv_blocks), num_kv_blocks, kv_step, init)
    seen = running_sum > 0  # False only for a query with no visible key (left padding)
    safe_sum = jnp.where(seen, running_sum, 1.0)
    out_ref[...] = jnp.where(seen[:, None], acc / safe_sum[:, None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, running_max + jnp.log(safe_sum), 0.0)


def _concentration_kernel(
    window_start_ref: jax.Ref,  # (bq,) int32: each query's window start
    q_ref: jax.Ref,
    k_ref: jax.Ref,
    lse_ref: jax.Ref,
    key_mask_ref: jax.Ref,
    segment_ref: jax.Ref,  # (padded,) int32: every key's segment
    query_segment_ref: jax.Ref,  # (bq,) int32
    herfindahl_ref: jax.Ref,
    *statistic_refs: jax.Ref,
    sm_scale: float,
    block_q: int,
    block_k: int,
    group: int,
    allow_tf32: bool,
    statistics: tuple[str, ...],
    sink_tokens: int,
) -> None:
    q_block = pl.program_id(0)
    num_heads = q_ref.shape[1]
    window_start = window_start_ref[...][:, None]  # (bq, 1)
    query_segment = query_segment_ref[...][:, None]
    queries = pl.ds(q_block * block_q, block_q)
    q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    names = partial_names(statistics)

    def kv_step(kv_block: Array, partials: tuple[Array, ...]) -> tuple[Array, ...]:
        keys = pl.ds(kv_block * block_k, block_k)

        def head_step(head: Array, head_sum: Array) -> Array:
            scores = pltriton.dot(
                q_ref[queries, head, :], k_ref[keys, lax.div(head, group), :], trans_b=True, allow_tf32=allow_tf32
            )
            return head_sum + jnp.exp(scores * sm_scale - lse_ref[head, queries][:, None])

        head_sum = lax.fori_loop(0, num_heads, head_step, jnp.zeros((block_q, block_k), jnp.float32))
        k_pos = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        in_window = (
            (k_pos <= q_pos)
            & (k_pos >= window_start)
            & (key_mask_ref[keys][None, :] != 0)
            & (segment_ref[keys][None, :] == query_segment)
        )
        block = window_partials(head_sum * (1.0 / num_heads), in_window, k_pos, window_start, statistics, sink_tokens)
        return tuple(merge_partials(name, running, block[name][:, 0]) for name, running in zip(names, partials))

    first = lax.div(jnp.min(window_start_ref[...]), block_k)
    last = lax.div((q_block + 1) * block_q + block_k - 1, block_k)
    zeros = tuple(jnp.zeros((block_q,), jnp.float32) for _ in names)  # the running max too: a >= 0
    partials = lax.fori_loop(jnp.minimum(first, last), last, kv_step, zeros)
    herfindahl, values = finish_statistics(dict(zip(names, partials)), statistics)
    herfindahl_ref[...] = herfindahl
    for name, ref in zip(statistics, statistic_refs):
        ref[...] = values[name]


def attention_with_concentration_gpu(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    window_start: Int[Array, " B"] | Int[Array, "B L"],
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
    return_lse: bool = False,
    statistics: Sequence[str] = (),
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    segment_ids: Int[Array, "B L"] | None = None,
) -> ConcentrationOutputs:
    """Blockwise attention with concentration via Triton; same contract as the package entry point.

    `return_lse=True` appends the per-head log-sum-exp of the scaled logits, [B, Hq, L] f32; a
    non-empty `statistics` appends {statistic: [B, L] f32}.
    """
    statistics = check_statistics(statistics, sink_tokens)
    batch, length, num_heads, head_dim, num_kv_heads = check_attention_inputs(
        q, k, v, attention_mask, window_start, segment_ids
    )
    block_q = block_q or min(64, max(16, pl.next_power_of_2(length)))
    block_k = block_k or min(64, max(16, pl.next_power_of_2(length)))
    for name, value in (("block_q", block_q), ("block_k", block_k), ("head_dim", head_dim)):
        if not _is_power_of_two(value):
            raise ValueError(f"{name}={value} must be a power of two >= 16 for the gpu backend")
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    group = num_heads // num_kv_heads
    padded = round_up(length, math.lcm(block_q, block_k))
    pad = ((0, 0), (0, padded - length), (0, 0), (0, 0))
    q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    per_token = lambda x, mode="constant": jnp.pad(x.astype(jnp.int32), ((0, 0), (0, padded - length)), mode=mode)
    key_mask = per_token(attention_mask)
    segments = row_segments(attention_mask, segment_ids)
    window_start = query_window_start(window_start, length)
    # Padded queries take the row's last values: they never lower a block's first key.
    query_window, query_first_key = per_token(window_start, "edge"), per_token(segment_starts(segments), "edge")
    segments = per_token(segments)
    num_q_blocks = padded // block_q
    allow_tf32 = q.dtype != jnp.float32  # fp32 inputs keep fp32 products
    params = pltriton.CompilerParams(num_warps=num_warps or (4 if head_dim <= 64 else 8), num_stages=num_stages)
    blocks = dict(sm_scale=scale, block_q=block_q, block_k=block_k, allow_tf32=allow_tf32)

    whole_kv = pl.BlockSpec((None, padded, None, head_dim), lambda i, b, h: (b, 0, lax.div(h, group), 0))
    q_tile = pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0))
    whole_row = pl.BlockSpec((None, padded), lambda i, b, h: (b, 0))
    query_row = pl.BlockSpec((None, block_q), lambda i, b, h: (b, i))
    out, lse = pl.pallas_call(
        functools.partial(_attention_kernel, **blocks),
        grid=(num_q_blocks, batch, num_heads),
        in_specs=[q_tile, whole_kv, whole_kv, whole_row, whole_row, query_row, query_row],
        out_specs=[q_tile, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[q, jax.ShapeDtypeStruct((batch, num_heads, padded), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="attention_with_lse",
    )(q, k, v, key_mask, segments, segments, query_first_key)

    row = jax.ShapeDtypeStruct((batch, padded), jnp.float32)
    herfindahl, *values = pl.pallas_call(
        functools.partial(_concentration_kernel, group=group, statistics=statistics, sink_tokens=sink_tokens, **blocks),
        grid=(num_q_blocks, batch),
        in_specs=[
            pl.BlockSpec((None, block_q), lambda i, b: (b, i)),
            pl.BlockSpec((None, padded, num_heads, head_dim), lambda i, b: (b, 0, 0, 0)),
            pl.BlockSpec((None, padded, num_kv_heads, head_dim), lambda i, b: (b, 0, 0, 0)),
            pl.BlockSpec((None, num_heads, padded), lambda i, b: (b, 0, 0)),
            pl.BlockSpec((None, padded), lambda i, b: (b, 0)),
            pl.BlockSpec((None, padded), lambda i, b: (b, 0)),
            pl.BlockSpec((None, block_q), lambda i, b: (b, i)),
        ],
        out_specs=[pl.BlockSpec((None, block_q), lambda i, b: (b, i))] * (1 + len(statistics)),
        out_shape=[row] * (1 + len(statistics)),
        compiler_params=params,
        interpret=interpret,
        name="attention_concentration",
    )(query_window, q, k, lse, key_mask, segments, segments)
    outputs: ConcentrationOutputs = (
        out[:, :length],
        herfindahl[:, :length],
        window_sizes(attention_mask, window_start),
    )
    if return_lse:
        outputs += (lse[:, :, :length],)
    return outputs + ({name: rows[:, :length] for name, rows in zip(statistics, values)},) if statistics else outputs
