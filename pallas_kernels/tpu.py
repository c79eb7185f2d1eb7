"""Mosaic (TPU) kernel: blockwise causal GQA attention plus the exact per-token concentration.

One `pallas_call` over the grid (batch, q block, phase, kv block). A program holds one q block
for ALL query heads, because the head average couples them (paper eq. herfindahl):

- phase 0 runs the online softmax over the causal kv blocks, per head, in fp32, and writes the
  attention output and the per-head log-sum-exp, which also stays in VMEM scratch.
- phase 1 revisits the kv blocks that meet the window [window_start_p, p] and recomputes the
  probabilities exactly from that LSE, p_hi = exp(s_hi - lse_h), sums them over heads, and
  accumulates sum_i a_i and sum_i a_i^2 over the window keys. H = (sum a^2) / (sum a)^2 is the
  Herfindahl index of the head-mean attention renormalized over the window. The optional
  statistics (`pallas_kernels.common.STATISTICS`: entropy, sink-masked Herfindahl, max weight)
  ride along as a few more running sums per query in the same pass.

Packed rows (`segment_ids`, several sequences per row): query p sees key i iff i <= p, key i is
real and both share a segment; its window starts at its own window_start_p ([B] per row or
[B, L] per query). As in JAX's splash attention, the per-query int32 data (segment id, window
start) enter as [B, Lp, 128] lane-replicated tiles read as (block_q, 1) columns, and the key
segment ids as a (1, block_k) row beside the key mask.

Nothing of size [L, L] exists: the largest arrays are the [Hq, block_q, D] q/out blocks and the
[block_q, block_k] logits of one head. Per-row statistics live as (block_q, 128) lane-replicated
tiles and the concentration leaves the kernel as a lane-major (1, block_q) row (one 2-D
transpose) of a [B, num_q_blocks, 1, block_q] array, so no lane<->sublane reshape is needed
(those fail on v4). Blocks that the causal mask rules out, that lie before the q block's
earliest segment start (phase 0) or before its earliest window start (phase 1) are skipped with
`pl.when` (the two per-(row, q block) minima are scalar-prefetched), and their index maps are
clamped so they are not fetched either.

With `interpret=True` the same kernel runs on CPU (the "interpret" backend, used by the tests).
No VJP is defined: this is the scoring pass (no gradient flows through it; see the package doc).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import (
    DEFAULT_SINK_TOKENS,
    MASK_VALUE,
    ConcentrationOutputs,
    block_minimum,
    check_attention_inputs,
    check_statistics,
    cut_blocks,
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

LANES = 128
# Mosaic's default scoped VMEM is 16 MiB; leave room for compiler temporaries.
VMEM_BUDGET_BYTES = 13 * 2**20


def vmem_bytes(
    num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int, block_q: int, block_k: int, partials: int = 2
) -> int:
    """Estimated VMEM of one program: double-buffered blocks (with the two int32 per-query tiles)
    plus fp32 scratch (`partials` window sums)."""
    q_and_out = 2 * 2 * num_heads * block_q * head_dim * itemsize + 2 * 2 * block_q * LANES * 4
    k_and_v = 2 * 2 * num_kv_heads * block_k * head_dim * itemsize
    scratch = num_heads * block_q * (2 * LANES + head_dim) * 4 + partials * block_q * LANES * 4
    temporaries = 3 * block_q * block_k * 4
    return q_and_out + k_and_v + scratch + temporaries


def default_block_sizes(
    length: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    *,
    lane_multiple: int = LANES,
    partials: int = 2,
) -> tuple[int, int]:
    """Largest (block_q, block_k) whose program fits VMEM_BUDGET_BYTES, cut to the row (`cut_blocks`):
    small L gets one block."""
    candidates = ((256, 512), (128, 512), (128, 256), (128, 128), (64, 256), (64, 128), (32, 128), (16, 128), (8, 128))
    for block_q, block_k in candidates:
        block_q, block_k = cut_blocks(length, block_q, block_k, lane_multiple)
        if vmem_bytes(num_heads, num_kv_heads, head_dim, itemsize, block_q, block_k, partials) <= VMEM_BUDGET_BYTES:
            return block_q, block_k
    raise ValueError(
        f"no block sizes fit {VMEM_BUDGET_BYTES >> 20} MiB of VMEM for {num_heads} q heads, {num_kv_heads} kv heads, "
        f"head dim {head_dim}; pass block_q/block_k explicitly"
    )


def _concentration_attention_kernel(
    first_key_ref: jax.Ref,  # [B * nq] int32 (SMEM): per (row, q block), the first key a query sees
    first_window_ref: jax.Ref,  # [B * nq] int32 (SMEM): per (row, q block), the earliest window start
    q_ref: jax.Ref,  # (Hq, bq, D)
    k_ref: jax.Ref,  # (Hkv, bk, D)
    v_ref: jax.Ref,  # (Hkv, bk, D)
    q_segment_ref: jax.Ref,  # (bq, LANES) int32, lane-replicated: each query's segment id
    q_window_ref: jax.Ref,  # (bq, LANES) int32, lane-replicated: each query's window start
    key_mask_ref: jax.Ref,  # (1, bk) int32, 1 = real token
    key_segment_ref: jax.Ref,  # (1, bk) int32: each key's segment id
    out_ref: jax.Ref,  # (Hq, bq, D)
    herfindahl_ref: jax.Ref,  # (1, bq) f32, lane-major
    lse_ref: jax.Ref,  # (Hq, 1, bq) f32, lane-major
    *refs: jax.Ref,  # one (1, bq) output per statistic, then the scratch below
    sm_scale: float,
    block_q: int,
    block_k: int,
    group: int,
    precision: lax.Precision,
    statistics: tuple[str, ...],
    sink_tokens: int,
) -> None:
    statistic_refs, refs = refs[: len(statistics)], refs[len(statistics) :]
    max_scratch, sum_scratch, acc_scratch = refs[:3]  # (Hq, bq, LANES): running max then LSE; denominator; (Hq, bq, D)
    partial_scratch = dict(
        zip(partial_names(statistics), refs[3:])
    )  # (bq, LANES) each: window sums (sum a, sum a^2, ...)
    batch, q_block, phase, kv_block = (pl.program_id(axis) for axis in range(4))
    num_heads = q_ref.shape[0]
    last_kv_block = lax.div((q_block + 1) * block_q - 1, block_k)
    causal_block = kv_block <= last_kv_block
    row_block = batch * pl.num_programs(1) + q_block
    first_key_block = lax.div(first_key_ref[row_block], block_k)
    first_window_block = lax.div(first_window_ref[row_block], block_k)

    q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    k_pos = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    same_segment = q_segment_ref[...][:, :1] == key_segment_ref[...]  # (bq, 1) vs (1, bk)
    visible = (k_pos <= q_pos) & (key_mask_ref[...] != 0) & same_segment

    def logits(head: Array) -> tuple[Array, Array]:
        kv_head = lax.div(head, group)
        scores = lax.dot_general(
            q_ref[head],
            k_ref[kv_head],
            (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=precision,
        )
        return scores * sm_scale, kv_head

    @pl.when((phase == 0) & (kv_block == 0))  # even when block 0 is skipped: the init reads no k/v
    def _init_softmax() -> None:
        max_scratch[...] = jnp.full(max_scratch.shape, MASK_VALUE, jnp.float32)
        sum_scratch[...] = jnp.zeros(sum_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    @pl.when((phase == 0) & causal_block & (kv_block >= first_key_block))
    def _online_softmax() -> None:
        def head_step(head: Array, carry: int) -> int:
            scores, kv_head = logits(head)
            scores = jnp.where(visible, scores, MASK_VALUE)
            max_prev = max_scratch[head]
            max_next = jnp.maximum(max_prev, jnp.max(scores, axis=1, keepdims=True))
            rescale = jnp.exp(max_prev - max_next)
            probs = jnp.where(visible, jnp.exp(scores - max_next[:, :1]), 0.0)
            sum_scratch[head] = rescale * sum_scratch[head] + jnp.sum(probs, axis=1, keepdims=True)
            values = lax.dot_general(
                probs.astype(v_ref.dtype),
                v_ref[kv_head],
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            acc_scratch[head] = rescale[:, :1] * acc_scratch[head] + values
            max_scratch[head] = max_next
            return carry

        lax.fori_loop(0, num_heads, head_step, 0)

    @pl.when((phase == 0) & (kv_block == last_kv_block))
    def _finish_softmax() -> None:
        def head_step(head: Array, carry: int) -> int:
            total = sum_scratch[head]
            seen = total > 0  # False only for a query with no visible key (left padding)
            safe_total = jnp.where(seen, total, 1.0)
            out_ref[head] = jnp.where(seen[:, :1], acc_scratch[head] / safe_total[:, :1], 0.0).astype(out_ref.dtype)
            lse = jnp.where(seen, max_scratch[head] + jnp.log(safe_total), 0.0)
            max_scratch[head] = lse
            lse_ref[head] = lse.T[:1, :]
            return carry

        lax.fori_loop(0, num_heads, head_step, 0)

    @pl.when((phase == 1) & (kv_block == 0))
    def _init_concentration() -> None:
        for scratch in partial_scratch.values():  # every partial starts at 0 (the running max too: a >= 0)
            scratch[...] = jnp.zeros(scratch.shape, jnp.float32)

    @pl.when((phase == 1) & causal_block & (kv_block >= first_window_block))
    def _accumulate_concentration() -> None:
        def head_step(head: Array, head_sum: Array) -> Array:
            scores, _ = logits(head)
            return head_sum + jnp.exp(scores - max_scratch[head][:, :1])

        head_sum = lax.fori_loop(0, num_heads, head_step, jnp.zeros((block_q, block_k), jnp.float32))
        window_start = q_window_ref[...][:, :1]  # (bq, 1)
        in_window = visible & (k_pos >= window_start)
        block = window_partials(head_sum * (1.0 / num_heads), in_window, k_pos, window_start, statistics, sink_tokens)
        for name, scratch in partial_scratch.items():
            scratch[...] = merge_partials(name, scratch[...], block[name])

    @pl.when((phase == 1) & (kv_block == pl.num_programs(3) - 1))
    def _finish_concentration() -> None:
        herfindahl, values = finish_statistics(
            {name: scratch[...] for name, scratch in partial_scratch.items()}, statistics
        )
        herfindahl_ref[...] = herfindahl.T[:1, :]
        for name, ref in zip(statistics, statistic_refs):
            ref[...] = values[name].T[:1, :]


def _kv_index_map(
    batch: Array,
    q_block: Array,
    phase: Array,
    kv_block: Array,
    first_key_ref: jax.Ref,
    first_window_ref: jax.Ref,
    *,
    block_q: int,
    block_k: int,
    num_q_blocks: int,
    keep_last_in_phase_1: bool,
) -> Array:
    """Clamps kv_block to the blocks the program computes on, so skipped steps fetch nothing new."""
    last = lax.div((q_block + 1) * block_q - 1, block_k)
    row_block = batch * num_q_blocks + q_block
    first = lax.div(jnp.where(phase == 1, first_window_ref[row_block], first_key_ref[row_block]), block_k)
    if keep_last_in_phase_1:  # v is not read in phase 1: hold the last phase-0 block
        first = jnp.where(phase == 1, last, first)
    return jnp.minimum(jnp.maximum(kv_block, first), last)


def attention_with_concentration_tpu(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    window_start: Int[Array, " B"] | Int[Array, "B L"],
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool = False,
    return_lse: bool = False,
    statistics: Sequence[str] = (),
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    segment_ids: Int[Array, "B L"] | None = None,
) -> ConcentrationOutputs:
    """Blockwise attention with concentration on TPU (or interpreted on CPU).

    Same contract as `pallas_kernels.attention_with_concentration`. On TPU block_q must be a
    multiple of 8 and block_k of 128 (interpreted: both multiples of 8); L is padded to a
    multiple of both internally. Default blocks are the largest that fit the VMEM budget.
    `return_lse=True` appends the per-head log-sum-exp of the scaled logits, [B, Hq, L] f32
    (0 for a query that sees no key); a non-empty `statistics` appends {statistic: [B, L] f32}.
    window_start is [B] (per row) or [B, L] (per query); `segment_ids` [B, L] packs several
    sequences (contiguous runs) per row, None is one per row.
    """
    statistics = check_statistics(statistics, sink_tokens)
    batch, length, num_heads, head_dim, num_kv_heads = check_attention_inputs(
        q, k, v, attention_mask, window_start, segment_ids
    )
    key_multiple = 8 if interpret else LANES
    default_q, default_k = default_block_sizes(
        length,
        num_heads,
        num_kv_heads,
        head_dim,
        q.dtype.itemsize,
        lane_multiple=key_multiple,
        partials=len(partial_names(statistics)),
    )
    block_q, block_k = block_q or default_q, block_k or default_k
    for name, block, multiple in (("block_q", block_q, 8), ("block_k", block_k, key_multiple)):
        if block % multiple:
            raise ValueError(
                f"{name}={block} must be a multiple of {multiple} for the {'interpret' if interpret else 'tpu'} backend"
            )
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    padded = round_up(length, math.lcm(block_q, block_k))
    pad = padded - length

    def heads_major(x: Array) -> Array:  # [B, L, H, D] -> [B, H, Lp, D]
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    segments = row_segments(attention_mask, segment_ids)
    window_start = query_window_start(window_start, length)
    num_q_blocks, num_kv_blocks = padded // block_q, padded // block_k
    # Per (row, q block), flattened to 1-D for SMEM: the first key any of its queries can see (its
    # earliest segment start; 0 without segments), and the earliest key of any of its windows
    # (keys before a query's segment start are invisible, so its window effectively starts at or
    # after that).
    starts = segment_starts(segments)
    first_key = block_minimum(starts, block_q, padded).reshape(-1)
    first_window = block_minimum(jnp.maximum(window_start, starts), block_q, padded).reshape(-1)

    def key_row(x: Array) -> Array:  # [B, L] -> [B, 1, Lp] int32
        return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, pad)))[:, None, :]

    def query_tile(x: Array) -> Array:  # [B, L] -> [B, Lp, LANES] int32, lane-replicated
        return jnp.broadcast_to(jnp.pad(x, ((0, 0), (0, pad)), mode="edge")[:, :, None], (batch, padded, LANES))

    kv_map = functools.partial(_kv_index_map, block_q=block_q, block_k=block_k, num_q_blocks=num_q_blocks)
    k_map = functools.partial(kv_map, keep_last_in_phase_1=False)
    v_map = functools.partial(kv_map, keep_last_in_phase_1=True)
    q_spec = pl.BlockSpec((None, num_heads, block_q, head_dim), lambda b, i, p, j, *_: (b, 0, i, 0))
    query_spec = pl.BlockSpec((None, block_q, LANES), lambda b, i, p, j, *_: (b, i, 0))
    key_spec = pl.BlockSpec((None, 1, block_k), lambda b, i, p, j, *s: (b, 0, k_map(b, i, p, j, *s)))
    row_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, i, p, j, *_: (b, i, 0, 0))
    row_shape = jax.ShapeDtypeStruct((batch, num_q_blocks, 1, block_q), jnp.float32)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, num_q_blocks, 2, num_kv_blocks),
        in_specs=[
            q_spec,
            pl.BlockSpec(
                (None, num_kv_heads, block_k, head_dim), lambda b, i, p, j, *s: (b, 0, k_map(b, i, p, j, *s), 0)
            ),
            pl.BlockSpec(
                (None, num_kv_heads, block_k, head_dim), lambda b, i, p, j, *s: (b, 0, v_map(b, i, p, j, *s), 0)
            ),
            query_spec,
            query_spec,
            key_spec,
            key_spec,
        ],
        out_specs=[
            q_spec,
            row_spec,
            pl.BlockSpec((None, None, num_heads, 1, block_q), lambda b, i, p, j, *_: (b, i, 0, 0, 0)),
        ]
        + [row_spec] * len(statistics),
        scratch_shapes=[
            pltpu.VMEM((num_heads, block_q, LANES), jnp.float32),
            pltpu.VMEM((num_heads, block_q, LANES), jnp.float32),
            pltpu.VMEM((num_heads, block_q, head_dim), jnp.float32),
        ]
        + [pltpu.VMEM((block_q, LANES), jnp.float32)] * len(partial_names(statistics)),
    )
    kernel = functools.partial(
        _concentration_attention_kernel,
        sm_scale=scale,
        block_q=block_q,
        block_k=block_k,
        group=num_heads // num_kv_heads,
        # fp32 inputs get fp32 matmuls on the MXU (its default would round them to bf16); 16-bit
        # inputs name DEFAULT, since Mosaic cannot compile them at a global "highest" precision.
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT,
        statistics=statistics,
        sink_tokens=sink_tokens,
    )
    out, herfindahl, lse, *values = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_heads, padded, head_dim), q.dtype),
            row_shape,
            jax.ShapeDtypeStruct((batch, num_q_blocks, num_heads, 1, block_q), jnp.float32),
        ]
        + [row_shape] * len(statistics),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="attention_with_concentration",
    )(
        first_key,
        first_window,
        heads_major(q),
        heads_major(k),
        heads_major(v),
        query_tile(segments),
        query_tile(window_start),
        key_row(attention_mask),
        key_row(segments),
    )
    out = out.transpose(0, 2, 1, 3)[:, :length]
    per_token = lambda rows: rows.reshape(batch, padded)[:, :length]
    outputs: ConcentrationOutputs = (out, per_token(herfindahl), window_sizes(attention_mask, window_start))
    if return_lse:
        outputs += (lse.transpose(0, 2, 1, 3, 4).reshape(batch, num_heads, padded)[:, :, :length],)
    return outputs + ({name: per_token(rows) for name, rows in zip(statistics, values)},) if statistics else outputs
