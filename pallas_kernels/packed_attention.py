"""Mosaic (TPU) causal GQA flash attention for training on packed rows: forward and backward that
skip the key blocks a query block cannot see because they belong to earlier segments.

A packed row of S tokens holds several sequences (contiguous runs of `segment_ids`). Query p sees
key i iff i <= p, key i is real (`attention_mask`) and both lie in the same run. JAX's splash
attention applies segment ids only elementwise inside the blocks it computes (its block skipping
comes from a static mask), so on a packed row it computes all ~S^2/2 causal blocks although each
sequence needs only l_i^2/2. Here the skip is dynamic, from the data:

- `segment_starts` gives each query the first position of its run; its block minimum over a q block
  is the first key any query of the block can see, so `first_kv_block[b, i]` = that // block_k. For
  contiguous runs it is non-decreasing in i.
- For a kv block j, the q blocks that can see one of its keys run from its causal diagonal
  `j * block_k // block_q` to `last_q_block[b, j]` = max i with first_kv_block[b, i] <= j (the
  last q block whose earliest segment start is at or before the block's last key).

Both bounds are computed in XLA (`block_bounds`) and scalar-prefetched (flattened to 1-D int32 for
SMEM). The visited (q block, kv block) pairs are exactly those holding a (query, key) pair with
i <= p in the same run (`visited_block_pairs` evaluates the kernels' own predicates); a block pair
whose keys are all padding is still visited (the bounds ignore the key mask).

Kernels (layouts as in `pallas_kernels.tpu`: heads-major [B, H, Lp, D] blocks, fp32 running
statistics in (block_q, LANES) lane-replicated scratch, per-query int data as [B, Lp, LANES]
lane-replicated tiles read as `ref[...][:, :1]`, per-key int data as (1, block_k) rows; the
dk/dv kernel swaps the two, because it works on transposed (key-major) logits):

- forward, grid (batch, kv head, q block, kv block): online softmax over kv blocks
  first_kv_block[b, i] .. diagonal(i) (the rest skipped with `pl.when`, and the kv index maps
  clamped into that range so skipped steps fetch nothing new); writes out and the per-head
  log-sum-exp LSE [B, Hq, 1, Lp] (lane-major rows), kept as a residual for the backward.
- dq, grid (batch, kv head, q block, kv block): the same kv blocks as the forward, FlashAttention-2
  style: P = exp(S - LSE), dS = P * (dO V^T - delta) with delta = rowsum(dO * O) precomputed in
  XLA, dq += dS K.
- dk/dv, grid (batch, kv head, kv block, q block): q blocks diagonal(j) .. last_q_block[b, j] (the
  rest skipped, q-side index maps clamped); on transposed logits S^T = K Q^T (block_k, block_q) the
  LSE and delta rows broadcast without a relayout: dv += P^T dO, dk += dS^T Q.

A program holds one kv head and its `group` = Hq / Hkv query heads (looped over inside the kernel),
so k/v are fetched once per group and dk/dv accumulate over the group in fp32 scratch; the kv head
sits in the grid rather than all heads in one program, to keep Qwen3-4B's 32 heads x 512 x 128 in
VMEM. Matmuls accumulate in fp32 (fp32 inputs at precision HIGHEST, 16-bit inputs DEFAULT).

Runs are identified by their start position inside the kernels (a key's code is its run start, -1
for padding), so two runs that reuse one segment id do not see each other: segments must be
contiguous runs, as everywhere in this package.

With `interpret=True` the same kernels run on CPU (the tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import (
    MASK_VALUE,
    block_minimum,
    check_attention_inputs,
    round_up,
    row_segments,
    segment_starts,
)

LANES = 128
# Default block size: with one kv head's group of q heads per program, 512 x 512 blocks of Qwen3-4B
# (D = 128, group 4) fit Mosaic's default 16 MiB of scoped VMEM (AOT-compiled: bf16 on v4, v5e, v5p
# and v6e, fp32 on v4 and v6e).
DEFAULT_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class _Config:
    sm_scale: float
    block_q: int
    block_k: int
    group: int
    interpret: bool


# --- Which (q block, kv block) pairs the kernels compute -------------------------------------------


def diagonal_kv_block(q_block: Array, block_q: int, block_k: int) -> Array:
    """The last kv block a q block can see (causal): ((i + 1) * block_q - 1) // block_k."""
    return lax.div((q_block + 1) * block_q - 1, block_k)


def diagonal_q_block(kv_block: Array, block_q: int, block_k: int) -> Array:
    """The first q block that can see a kv block (causal): j * block_k // block_q."""
    return lax.div(kv_block * block_k, block_q)


def forward_visits(q_block: Array, kv_block: Array, first_kv_block: Array, block_q: int, block_k: int) -> Array:
    """Whether the forward and dq kernels compute (q block, kv block): first_kv_block <= j <= diagonal(i).
    Works on the kernels' scalars and on broadcast arrays alike."""
    return (kv_block >= first_kv_block) & (kv_block <= diagonal_kv_block(q_block, block_q, block_k))


def dkdv_visits(q_block: Array, kv_block: Array, last_q_block: Array, block_q: int, block_k: int) -> Array:
    """Whether the dk/dv kernel computes (q block, kv block): diagonal(j) <= i <= last_q_block."""
    return (q_block >= diagonal_q_block(kv_block, block_q, block_k)) & (q_block <= last_q_block)


def block_bounds(query_starts: Int[Array, "B Lp"], block_q: int, block_k: int) -> tuple[Array, Array]:
    """(first_kv_block [B, nq], last_q_block [B, nk]) int32 from each (padded) query's segment start:
    the first kv block any query of q block i can see, and the last q block that can see a key of kv
    block j (max i with first_kv_block[b, i] <= j; first_kv_block is non-decreasing in i)."""
    padded = query_starts.shape[1]
    first_kv_block = block_minimum(query_starts, block_q, padded) // block_k
    kv_blocks = jnp.arange(padded // block_k, dtype=jnp.int32)
    last_q_block = jnp.sum(first_kv_block[:, :, None] <= kv_blocks[None, None, :], axis=1, dtype=jnp.int32) - 1
    return first_kv_block.astype(jnp.int32), last_q_block


def visited_block_pairs(
    first_kv_block: Int[Array, "B nq"], last_q_block: Int[Array, "B nk"], block_q: int, block_k: int
) -> tuple[Bool[Array, "B nq nk"], Bool[Array, "B nq nk"]]:
    """(forward/dq pairs, dk/dv pairs) [B, nq, nk] bool: the (q block, kv block) pairs each kernel
    computes, from its scalar-prefetch bounds, by the predicates its `pl.when` uses."""
    num_q_blocks, num_kv_blocks = first_kv_block.shape[1], last_q_block.shape[1]
    q_blocks = jnp.arange(num_q_blocks, dtype=jnp.int32)[None, :, None]
    kv_blocks = jnp.arange(num_kv_blocks, dtype=jnp.int32)[None, None, :]
    forward = forward_visits(q_blocks, kv_blocks, first_kv_block[:, :, None], block_q, block_k)
    dkdv = dkdv_visits(q_blocks, kv_blocks, last_q_block[:, None, :], block_q, block_k)
    return forward, dkdv


# --- Kernels ---------------------------------------------------------------------------------------


def _dot(a: Array, b: Array, contract: tuple[int, int], precision: lax.Precision) -> Array:
    """fp32-accumulated 2-D matmul contracting a's dim contract[0] with b's dim contract[1]."""
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )


def _forward_kernel(
    first_kv_ref: jax.Ref,  # [B * nq] int32 (SMEM): first kv block of each (row, q block)
    q_ref: jax.Ref,  # (G, bq, D)
    k_ref: jax.Ref,  # (bk, D)
    v_ref: jax.Ref,  # (bk, D)
    q_start_ref: jax.Ref,  # (bq, LANES) int32, lane-replicated: each query's segment start
    key_code_ref: jax.Ref,  # (1, bk) int32: each key's segment start, -1 for padding
    out_ref: jax.Ref,  # (G, bq, D)
    lse_ref: jax.Ref,  # (G, 1, bq) f32, lane-major
    max_scratch: jax.Ref,  # (G, bq, LANES) f32: running max
    sum_scratch: jax.Ref,  # (G, bq, LANES) f32: running denominator
    acc_scratch: jax.Ref,  # (G, bq, D) f32: running numerator
    *,
    sm_scale: float,
    block_q: int,
    block_k: int,
    precision: lax.Precision,
) -> None:
    batch, q_block, kv_block = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    first_kv_block = first_kv_ref[batch * pl.num_programs(2) + q_block]
    group = q_ref.shape[0]

    @pl.when(kv_block == 0)  # even when block 0 is skipped: the init reads no k/v
    def _init() -> None:
        max_scratch[...] = jnp.full(max_scratch.shape, MASK_VALUE, jnp.float32)
        sum_scratch[...] = jnp.zeros(sum_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    @pl.when(forward_visits(q_block, kv_block, first_kv_block, block_q, block_k))
    def _online_softmax() -> None:
        q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
        k_pos = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        visible = (k_pos <= q_pos) & (q_start_ref[...][:, :1] == key_code_ref[...])
        k, v = k_ref[...], v_ref[...]

        def head_step(head: Array, carry: int) -> int:
            scores = jnp.where(visible, _dot(q_ref[head], k, (1, 1), precision) * sm_scale, MASK_VALUE)
            max_prev = max_scratch[head]
            max_next = jnp.maximum(max_prev, jnp.max(scores, axis=1, keepdims=True))
            rescale = jnp.exp(max_prev - max_next)
            probs = jnp.where(visible, jnp.exp(scores - max_next[:, :1]), 0.0)
            sum_scratch[head] = rescale * sum_scratch[head] + jnp.sum(probs, axis=1, keepdims=True)
            acc_scratch[head] = rescale[:, :1] * acc_scratch[head] + _dot(probs.astype(v.dtype), v, (1, 0), precision)
            max_scratch[head] = max_next
            return carry

        lax.fori_loop(0, group, head_step, 0)

    @pl.when(kv_block == diagonal_kv_block(q_block, block_q, block_k))
    def _finish() -> None:
        def head_step(head: Array, carry: int) -> int:
            total = sum_scratch[head]
            seen = total > 0  # False only for a query that sees no key (padding)
            safe_total = jnp.where(seen, total, 1.0)
            out_ref[head] = jnp.where(seen[:, :1], acc_scratch[head] / safe_total[:, :1], 0.0).astype(out_ref.dtype)
            lse = jnp.where(seen, max_scratch[head] + jnp.log(safe_total), 0.0)
            lse_ref[head] = lse.T[:1, :]
            return carry

        lax.fori_loop(0, group, head_step, 0)


def _dq_kernel(
    first_kv_ref: jax.Ref,  # [B * nq] int32 (SMEM)
    q_ref: jax.Ref,  # (G, bq, D)
    k_ref: jax.Ref,  # (bk, D)
    v_ref: jax.Ref,  # (bk, D)
    do_ref: jax.Ref,  # (G, bq, D)
    lse_ref: jax.Ref,  # (G, 1, bq) f32, lane-major
    delta_ref: jax.Ref,  # (G, 1, bq) f32, lane-major
    q_start_ref: jax.Ref,  # (bq, LANES) int32, lane-replicated
    key_code_ref: jax.Ref,  # (1, bk) int32
    dq_ref: jax.Ref,  # (G, bq, D)
    lse_scratch: jax.Ref,  # (G, bq, LANES) f32: the LSE as lane-replicated columns
    delta_scratch: jax.Ref,  # (G, bq, LANES) f32: delta likewise
    dq_scratch: jax.Ref,  # (G, bq, D) f32
    *,
    sm_scale: float,
    block_q: int,
    block_k: int,
    precision: lax.Precision,
) -> None:
    batch, q_block, kv_block = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    first_kv_block = first_kv_ref[batch * pl.num_programs(2) + q_block]
    group = q_ref.shape[0]

    @pl.when(kv_block == 0)
    def _init() -> None:
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, jnp.float32)

        def head_step(head: Array, carry: int) -> int:  # (1, bq) rows -> (bq, LANES) columns, once per q block
            lse_scratch[head] = jnp.broadcast_to(lse_ref[head], (LANES, block_q)).T
            delta_scratch[head] = jnp.broadcast_to(delta_ref[head], (LANES, block_q)).T
            return carry

        lax.fori_loop(0, group, head_step, 0)

    @pl.when(forward_visits(q_block, kv_block, first_kv_block, block_q, block_k))
    def _accumulate() -> None:
        q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
        k_pos = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        visible = (k_pos <= q_pos) & (q_start_ref[...][:, :1] == key_code_ref[...])
        k, v = k_ref[...], v_ref[...]

        def head_step(head: Array, carry: int) -> int:
            scores = jnp.where(visible, _dot(q_ref[head], k, (1, 1), precision) * sm_scale, MASK_VALUE)
            probs = jnp.exp(scores - lse_scratch[head][:, :1])  # 0 where not visible
            dprobs = _dot(do_ref[head], v, (1, 1), precision)
            dscores = probs * (dprobs - delta_scratch[head][:, :1])
            dq_scratch[head] += _dot(dscores.astype(k.dtype), k, (1, 0), precision)
            return carry

        lax.fori_loop(0, group, head_step, 0)

    @pl.when(kv_block == diagonal_kv_block(q_block, block_q, block_k))
    def _finish() -> None:
        dq_ref[...] = (dq_scratch[...] * sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    last_q_ref: jax.Ref,  # [B * nk] int32 (SMEM): last q block of each (row, kv block)
    q_ref: jax.Ref,  # (G, bq, D)
    k_ref: jax.Ref,  # (bk, D)
    v_ref: jax.Ref,  # (bk, D)
    do_ref: jax.Ref,  # (G, bq, D)
    lse_ref: jax.Ref,  # (G, 1, bq) f32, lane-major
    delta_ref: jax.Ref,  # (G, 1, bq) f32, lane-major
    q_start_ref: jax.Ref,  # (1, bq) int32: each query's segment start
    key_code_ref: jax.Ref,  # (bk, LANES) int32, lane-replicated: each key's segment start, -1 for padding
    dk_ref: jax.Ref,  # (bk, D)
    dv_ref: jax.Ref,  # (bk, D)
    dk_scratch: jax.Ref,  # (bk, D) f32
    dv_scratch: jax.Ref,  # (bk, D) f32
    *,
    sm_scale: float,
    block_q: int,
    block_k: int,
    precision: lax.Precision,
) -> None:
    batch, kv_block, q_block = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    last_q_block = last_q_ref[batch * pl.num_programs(2) + kv_block]
    group = q_ref.shape[0]

    @pl.when(q_block == 0)
    def _init() -> None:
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, jnp.float32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, jnp.float32)

    @pl.when(dkdv_visits(q_block, kv_block, last_q_block, block_q, block_k))
    def _accumulate() -> None:
        k_pos = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k, block_q), 0)
        q_pos = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_k, block_q), 1)
        visible = (k_pos <= q_pos) & (key_code_ref[...][:, :1] == q_start_ref[...])  # (bk, bq): transposed
        k, v = k_ref[...], v_ref[...]

        def head_step(head: Array, carry: int) -> int:
            q, d_out = q_ref[head], do_ref[head]
            scores = jnp.where(visible, _dot(k, q, (1, 1), precision) * sm_scale, MASK_VALUE)
            probs = jnp.exp(scores - lse_ref[head])  # (bk, bq) - (1, bq); 0 where not visible
            dv_scratch[...] += _dot(probs.astype(d_out.dtype), d_out, (1, 0), precision)
            dprobs = _dot(v, d_out, (1, 1), precision)
            dscores = probs * (dprobs - delta_ref[head])
            dk_scratch[...] += _dot(dscores.astype(q.dtype), q, (1, 0), precision)
            return carry

        lax.fori_loop(0, group, head_step, 0)

    @pl.when(q_block == pl.num_programs(3) - 1)
    def _finish() -> None:
        dk_ref[...] = (dk_scratch[...] * sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


# --- pallas_calls ----------------------------------------------------------------------------------


def _precision(dtype: jnp.dtype) -> lax.Precision:
    """fp32 inputs get fp32 matmuls on the MXU (its default would round them to bf16); 16-bit inputs
    name DEFAULT, since Mosaic cannot compile them at a global "highest" precision."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _query_tile(x: Int[Array, "B Lp"]) -> Int[Array, "B Lp LANES"]:
    """[B, Lp] int32 -> [B, Lp, LANES], lane-replicated (read in a kernel as `ref[...][:, :1]`)."""
    return jnp.broadcast_to(x[:, :, None], (*x.shape, LANES))


_COMPILER_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _clamped_kv_block(
    b: Array, i: Array, j: Array, first_ref: jax.Ref, *, num_q_blocks: int, block_q: int, block_k: int
) -> Array:
    """The forward/dq kv index map's block: kv block j of (row b, q block i) clamped to
    first_kv_block .. diagonal(i), the blocks the program computes on, so skipped steps fetch nothing new."""
    first = first_ref[b * num_q_blocks + i]
    return jnp.minimum(jnp.maximum(j, first), diagonal_kv_block(i, block_q, block_k))


def _forward(
    config: _Config,
    q: Float[Array, "B Hq Lp D"],
    k: Float[Array, "B Hkv Lp D"],
    v: Float[Array, "B Hkv Lp D"],
    first_kv_block: Int[Array, "B nq"],
    query_starts: Int[Array, "B Lp"],
    key_codes: Int[Array, "B Lp"],
) -> tuple[Float[Array, "B Hq Lp D"], Float[Array, "B Hq 1 Lp"]]:
    """(out [B, Hq, Lp, D], lse [B, Hq, 1, Lp] f32) on heads-major padded inputs."""
    batch, num_heads, padded, head_dim = q.shape
    num_kv_heads, block_q, block_k, group = k.shape[1], config.block_q, config.block_k, config.group
    num_q_blocks, num_kv_blocks = padded // block_q, padded // block_k

    kv_block_index = functools.partial(_clamped_kv_block, num_q_blocks=num_q_blocks, block_q=block_q, block_k=block_k)
    q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda b, h, i, j, *_: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, head_dim), lambda b, h, i, j, f: (b, h, kv_block_index(b, i, j, f), 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, num_kv_heads, num_q_blocks, num_kv_blocks),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, block_q, LANES), lambda b, h, i, j, *_: (b, i, 0)),
            pl.BlockSpec((None, 1, block_k), lambda b, h, i, j, f: (b, 0, kv_block_index(b, i, j, f))),
        ],
        out_specs=[q_spec, pl.BlockSpec((None, group, 1, block_q), lambda b, h, i, j, *_: (b, h, 0, i))],
        scratch_shapes=[
            pltpu.VMEM((group, block_q, LANES), jnp.float32),
            pltpu.VMEM((group, block_q, LANES), jnp.float32),
            pltpu.VMEM((group, block_q, head_dim), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _forward_kernel, sm_scale=config.sm_scale, block_q=block_q, block_k=block_k, precision=_precision(q.dtype)
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, 1, padded), jnp.float32),
        ],
        compiler_params=_COMPILER_PARAMS,
        interpret=config.interpret,
        name="packed_flash_attention_forward",
    )(first_kv_block.reshape(-1), q, k, v, _query_tile(query_starts), key_codes[:, None, :])
    return out, lse


def _backward(
    config: _Config,
    q: Float[Array, "B Hq Lp D"],
    k: Float[Array, "B Hkv Lp D"],
    v: Float[Array, "B Hkv Lp D"],
    out: Float[Array, "B Hq Lp D"],
    lse: Float[Array, "B Hq 1 Lp"],
    d_out: Float[Array, "B Hq Lp D"],
    first_kv_block: Int[Array, "B nq"],
    last_q_block: Int[Array, "B nk"],
    query_starts: Int[Array, "B Lp"],
    key_codes: Int[Array, "B Lp"],
) -> tuple[Float[Array, "B Hq Lp D"], Float[Array, "B Hkv Lp D"], Float[Array, "B Hkv Lp D"]]:
    """(dq, dk, dv), heads-major padded, from the forward's out and LSE and the output cotangent."""
    batch, num_heads, padded, head_dim = q.shape
    num_kv_heads, block_q, block_k, group = k.shape[1], config.block_q, config.block_k, config.group
    num_q_blocks, num_kv_blocks = padded // block_q, padded // block_k
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[:, :, None, :]  # [B, Hq, 1, Lp]
    precision = _precision(q.dtype)

    # dq: grid (batch, kv head, q block, kv block), the forward's kv blocks.
    kv_block_index = functools.partial(_clamped_kv_block, num_q_blocks=num_q_blocks, block_q=block_q, block_k=block_k)
    q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda b, h, i, j, *_: (b, h, i, 0))
    row_spec = pl.BlockSpec((None, group, 1, block_q), lambda b, h, i, j, *_: (b, h, 0, i))
    kv_spec = pl.BlockSpec((None, None, block_k, head_dim), lambda b, h, i, j, f: (b, h, kv_block_index(b, i, j, f), 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, sm_scale=config.sm_scale, block_q=block_q, block_k=block_k, precision=precision),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, num_kv_heads, num_q_blocks, num_kv_blocks),
            in_specs=[
                q_spec,
                kv_spec,
                kv_spec,
                q_spec,
                row_spec,
                row_spec,
                pl.BlockSpec((None, block_q, LANES), lambda b, h, i, j, *_: (b, i, 0)),
                pl.BlockSpec((None, 1, block_k), lambda b, h, i, j, f: (b, 0, kv_block_index(b, i, j, f))),
            ],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((group, block_q, LANES), jnp.float32),
                pltpu.VMEM((group, block_q, LANES), jnp.float32),
                pltpu.VMEM((group, block_q, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_COMPILER_PARAMS,
        interpret=config.interpret,
        name="packed_flash_attention_dq",
    )(first_kv_block.reshape(-1), q, k, v, d_out, lse, delta, _query_tile(query_starts), key_codes[:, None, :])

    # dk/dv: grid (batch, kv head, kv block, q block), q blocks diagonal(j) .. last_q_block[b, j].
    def q_block_index(b: Array, j: Array, i: Array, last_ref: jax.Ref) -> Array:
        last = last_ref[b * num_kv_blocks + j]
        return jnp.minimum(jnp.maximum(i, diagonal_q_block(j, block_q, block_k)), last)

    q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda b, h, j, i, s: (b, h, q_block_index(b, j, i, s), 0))
    row_spec = pl.BlockSpec((None, group, 1, block_q), lambda b, h, j, i, s: (b, h, 0, q_block_index(b, j, i, s)))
    kv_spec = pl.BlockSpec((None, None, block_k, head_dim), lambda b, h, j, i, *_: (b, h, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkdv_kernel, sm_scale=config.sm_scale, block_q=block_q, block_k=block_k, precision=precision
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, num_kv_heads, num_kv_blocks, num_q_blocks),
            in_specs=[
                q_spec,
                kv_spec,
                kv_spec,
                q_spec,
                row_spec,
                row_spec,
                pl.BlockSpec((None, 1, block_q), lambda b, h, j, i, s: (b, 0, q_block_index(b, j, i, s))),
                pl.BlockSpec((None, block_k, LANES), lambda b, h, j, i, *_: (b, j, 0)),
            ],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[
                pltpu.VMEM((block_k, head_dim), jnp.float32),
                pltpu.VMEM((block_k, head_dim), jnp.float32),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_COMPILER_PARAMS,
        interpret=config.interpret,
        name="packed_flash_attention_dkdv",
    )(last_q_block.reshape(-1), q, k, v, d_out, lse, delta, query_starts[:, None, :], _query_tile(key_codes))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(
    config: _Config,
    q: Array,
    k: Array,
    v: Array,
    first_kv_block: Array,
    last_q_block: Array,
    query_starts: Array,
    key_codes: Array,
) -> Array:
    """out [B, Hq, Lp, D] from heads-major padded q [B, Hq, Lp, D], k and v [B, Hkv, Lp, D], the block
    bounds first_kv_block [B, nq] and last_q_block [B, nk], query_starts and key_codes [B, Lp] int32;
    differentiable in q, k, v only."""
    return _forward(config, q, k, v, first_kv_block, query_starts, key_codes)[0]


def _attention_forward(
    config: _Config,
    q: Array,
    k: Array,
    v: Array,
    first_kv_block: Array,
    last_q_block: Array,
    query_starts: Array,
    key_codes: Array,
) -> tuple[Array, tuple[Array, ...]]:
    """(out, residuals): q, k, v, out, lse [B, Hq, 1, Lp] f32 and the int inputs, for the backward."""
    out, lse = _forward(config, q, k, v, first_kv_block, query_starts, key_codes)
    return out, (q, k, v, out, lse, first_kv_block, last_q_block, query_starts, key_codes)


def _attention_backward(config: _Config, residuals: tuple[Array, ...], d_out: Array) -> tuple[Array | None, ...]:
    """(dq [B, Hq, Lp, D], dk, dv [B, Hkv, Lp, D], None x 4) from d_out [B, Hq, Lp, D]."""
    q, k, v, out, lse, first_kv_block, last_q_block, query_starts, key_codes = residuals
    dq, dk, dv = _backward(config, q, k, v, out, lse, d_out, first_kv_block, last_q_block, query_starts, key_codes)
    return dq, dk, dv, None, None, None, None  # the int block bounds and codes get no cotangent


_attention.defvjp(_attention_forward, _attention_backward)


# --- Public entry point ----------------------------------------------------------------------------


def default_block_sizes(length: int, *, interpret: bool = False) -> tuple[int, int]:
    """(block_q, block_k): min(512, L rounded up to 128 (interpret: 8)) each."""
    block = min(DEFAULT_BLOCK, round_up(length, 8 if interpret else LANES))
    return block, block


def check_block_sizes(block_q: int, block_k: int, *, interpret: bool) -> None:
    """A ValueError naming a block size that is not a positive multiple of 128 (interpret: 8): on TPU
    both are lane dimensions (the LSE rows, the key and query rows, the transposed logits)."""
    multiple = 8 if interpret else LANES
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(block, int) or isinstance(block, bool) or block <= 0 or block % multiple:
            raise ValueError(
                f"{name}={block!r} must be a positive multiple of {multiple} for the "
                f"{'interpret' if interpret else 'tpu'} backend"
            )


def packed_inputs(
    attention_mask: Bool[Array, "B L"], segment_ids: Int[Array, "B L"] | None, padded: int
) -> tuple[Int[Array, "B Lp"], Int[Array, "B Lp"]]:
    """(query_starts, key_codes) [B, Lp] int32: each query's segment start (queries past L count as the
    row's last), and each key's segment start or -1 for padding (and past L). Query p sees key i iff
    i <= p and key_codes[i] == query_starts[p]."""
    starts = segment_starts(row_segments(attention_mask, segment_ids))
    pad = ((0, 0), (0, padded - starts.shape[1]))
    query_starts = jnp.pad(starts, pad, mode="edge")
    key_codes = jnp.pad(jnp.where(attention_mask, starts, -1), pad, constant_values=-1)
    return query_starts, key_codes


def packed_flash_attention(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    segment_ids: Int[Array, "B L"] | None = None,
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool = False,
) -> Float[Array, "B L Hq D"]:
    """Causal GQA attention on packed rows, out [B, L, Hq, D], differentiable in q, k, v (its own
    Mosaic backward); the same as `pallas_kernels.common.causal_attention(q, k, v, attention_mask,
    sm_scale=sm_scale, segment_ids=segment_ids)`.

    q [B, L, Hq, D], k and v [B, L, Hkv, D] (Hq a multiple of Hkv; bf16 or fp32), attention_mask
    [B, L] bool, segment_ids [B, L] int (contiguous runs; None: one segment per row). Query p sees key
    i iff i <= p, key i is real and both share a segment; a query that sees no key gets 0 and no
    gradient. sm_scale defaults to D^-0.5. block_q, block_k: positive multiples of 128 on TPU (8 with
    `interpret=True`), default min(512, L rounded up); L is padded to a multiple of
    lcm(block_q, block_k) internally.
    """
    batch, length, num_heads, head_dim, num_kv_heads = check_attention_inputs(
        q, k, v, attention_mask, None, segment_ids
    )
    default_q, default_k = default_block_sizes(length, interpret=interpret)
    block_q = default_q if block_q is None else block_q
    block_k = default_k if block_k is None else block_k
    check_block_sizes(block_q, block_k, interpret=interpret)
    padded = round_up(length, math.lcm(block_q, block_k))
    config = _Config(
        sm_scale=head_dim**-0.5 if sm_scale is None else float(sm_scale),
        block_q=block_q,
        block_k=block_k,
        group=num_heads // num_kv_heads,
        interpret=interpret,
    )
    query_starts, key_codes = packed_inputs(attention_mask, segment_ids, padded)
    first_kv_block, last_q_block = block_bounds(query_starts, block_q, block_k)

    def heads_major(x: Array) -> Array:  # [B, L, H, D] -> [B, H, Lp, D]
        return jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    out = _attention(
        config, heads_major(q), heads_major(k), heads_major(v), first_kv_block, last_q_block, query_starts, key_codes
    )
    return out.transpose(0, 2, 1, 3)[:, :length]


__all__ = [
    "block_bounds",
    "check_block_sizes",
    "default_block_sizes",
    "dkdv_visits",
    "forward_visits",
    "packed_flash_attention",
    "packed_inputs",
    "visited_block_pairs",
]
