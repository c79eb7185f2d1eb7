"""Mosaic (TPU) decode attention over an 8-bit paged KV cache with a scale per (token, kv head).

Why: the rollout engine's 8-bit pages keep one float32 scale per token and kv head, so the
dequantized key is `k_pages[h, page, slot, :].astype(f32) * (key scale of (page, h, slot))`. JAX's
TPU ragged paged attention takes one static scale per tensor, and its older paged_attention wants
the scales broadcast to [.., head_dim] (more bytes than bf16 pages), so neither reads this cache.

Layout (`comppo_jax.models.paged_cache`, 8-bit "heads_first" pages with "scale_rows"): k_pages,
v_pages [Hkv, P, ps, hd] int8 or float8_e4m3fn and scale_rows [P, Hkv * 2 * ps] float32, one row
per page holding each kv head's ps key scales, then its ps value scales; all left in HBM
(`memory_space=ANY`). Row s's token i is at page `page_indices[s, i // ps]`, slot `i % ps`; the
row attends tokens 0 .. lengths[s] - 1. q [S, Hq, hd] enters as [S, Hkv, G, hd] (G = Hq / Hkv,
query head j reads kv head j // G), so each kv head's G queries are one matmul's rows.

Grid (core, row, block), blocks of `pages_per_block` pages of one row and ALL kv heads: a page is
3 DMAs (its keys and values of every head, strided, and its scale row), and a step moves Hkv
times the bytes a per-head grid would, so the ~0.35 us per-step overhead stays small next to the
copy (Qwen3-4B split over 8 chips has one kv head per chip, whose blocks would otherwise be
tiny). The leading `core` axis (2 when S is even) is "parallel": megacore chips (v4, v5p) run
half of the rows on each TensorCore; single-core chips run the halves one after another.

DMA schedule, per core a chain over its rows' blocks, double-buffered in VMEM (the slot in SMEM
scratch): the chain's first step starts its own block's copies; every step that computes starts
the NEXT block's copies (the row's next block, else the next row's first) into the other slot,
then waits for its own and computes. Steps past a row's last block (ceil(lengths[s] /
(pages_per_block * ps)) blocks, at least 1) issue nothing, and within a block only the pages
below ceil(lengths[s] / ps) are copied (a dynamic loop), so no page past a row's length is read.
`lengths` and the flattened page table are scalar-prefetched into SMEM.

Compute, per kv head and per chunk of `chunk_pages` copied pages (a dynamic loop: no compute on
pages past the length): logits = q_h k^T with 8-bit keys widened to q's dtype (exact for int8
and e4m3 in bf16), times the key scales as a (1, chunk) row and sm_scale; an online softmax in
fp32 (running max, denominator and [G, hd] accumulator, in VMEM scratch between blocks);
probabilities times the value scales, then @ v. Slots past the length (stale data or NaN) are
masked out of the logits and probabilities, and fp8 values are zeroed there (0 * NaN). No
dequantized pool is ever written. fp32 q gets fp32 matmuls (HIGHEST), bf16 q bf16 ones.

With `interpret=True` the kernel runs under Pallas' TPU interpreter on CPU (the tests), whose
uninitialized VMEM is NaN and whose out-of-bounds DMAs raise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.common import MASK_VALUE

LANES = 128
SUBLANES = 8
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
# The default block: the most pages whose keys and values (all kv heads) take at most
# BLOCK_BYTES (~2.5 us of HBM bandwidth, against ~0.35 us of per-step overhead), within the
# table width and VMEM_BUDGET_BYTES (Mosaic's default scoped VMEM is 16 MiB on v5e).
BLOCK_BYTES = 2 * 2**20
VMEM_BUDGET_BYTES = 12 * 2**20
# Tokens per compute chunk: the kernel computes on the copied pages only, a chunk at a time.
CHUNK_TOKENS = 256


def chunk_pages(pages_per_block: int, page_size: int) -> int:
    """Pages per compute chunk: the largest divisor of pages_per_block with at most CHUNK_TOKENS tokens."""
    most = max(1, CHUNK_TOKENS // page_size)
    return max(d for d in range(1, min(most, pages_per_block) + 1) if pages_per_block % d == 0)


def vmem_bytes(
    pages_per_block: int, page_size: int, num_kv_heads: int, group: int, head_dim: int, q_itemsize: int
) -> int:
    """Estimated VMEM of one program: double-buffered 8-bit pages and (tile-padded) scales, the q
    and out blocks, fp32 scratch, and one chunk's widened keys, values and logits."""
    pad = lambda n, multiple: -(-n // multiple) * multiple
    chunk = chunk_pages(pages_per_block, page_size)
    pages = 2 * 2 * num_kv_heads * pages_per_block * page_size * head_dim
    scales = 2 * pages_per_block // chunk * pad(chunk, SUBLANES) * pad(2 * num_kv_heads * page_size, LANES) * 4
    rows = pad(group, SUBLANES)
    q_and_out = 2 * 2 * num_kv_heads * rows * head_dim * q_itemsize
    scratch = num_kv_heads * rows * (2 * LANES + head_dim) * 4
    tokens = chunk * page_size
    temporaries = 2 * tokens * head_dim * 4 + 4 * rows * pad(tokens, LANES) * 4
    return pages + scales + q_and_out + scratch + temporaries


def default_pages_per_block(
    table_width: int, page_size: int, num_kv_heads: int, group: int, head_dim: int, q_itemsize: int
) -> int:
    """The most pages, up to BLOCK_BYTES of keys and values and the table width, that fit
    VMEM_BUDGET_BYTES, rounded down to whole compute chunks."""
    page_bytes = 2 * num_kv_heads * page_size * head_dim
    pages = max(1, min(table_width, BLOCK_BYTES // page_bytes))
    chunk = max(1, CHUNK_TOKENS // page_size)
    if pages > chunk:
        pages -= pages % chunk
    while pages > 1 and vmem_bytes(pages, page_size, num_kv_heads, group, head_dim, q_itemsize) > VMEM_BUDGET_BYTES:
        pages -= 1
    return pages


def _kernel(
    lengths_ref: jax.Ref,  # [S] int32 (SMEM)
    tables_ref: jax.Ref,  # [S * W] int32 (SMEM): the flattened page table
    q_ref: jax.Ref,  # (Hkv, G, hd)
    k_hbm: jax.Ref,  # [Hkv, P, ps, hd] 8-bit (HBM)
    v_hbm: jax.Ref,
    scales_hbm: jax.Ref,  # [P, Hkv * 2 * ps] f32 (HBM): per page, each head's key then value scales
    out_ref: jax.Ref,  # (Hkv, G, hd)
    k_buffer: jax.Ref,  # (2, Hkv, ppb, ps, hd) 8-bit: double-buffered blocks
    v_buffer: jax.Ref,
    scales_buffer: jax.Ref,  # (2, ppb // cp, cp, Hkv * 2 * ps) f32: cp pages per compute chunk
    semaphores: jax.Ref,  # DMA (2,): one per slot
    slot_ref: jax.Ref,  # (1,) int32 (SMEM): the slot holding this step's block
    max_scratch: jax.Ref,  # (Hkv, G, LANES) f32, lane-replicated
    sum_scratch: jax.Ref,  # (Hkv, G, LANES) f32, lane-replicated
    acc_scratch: jax.Ref,  # (Hkv, G, hd) f32
    *,
    sm_scale: float,
    rows_per_core: int,
    table_width: int,
    precision: lax.Precision,
) -> None:
    core, local_row, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = core * rows_per_core + local_row
    num_kv_heads, pages_per_block, page_size, head_dim = k_buffer.shape[1:]
    chunk = scales_buffer.shape[2]  # pages per compute chunk
    block_tokens, chunk_tokens = pages_per_block * page_size, chunk * page_size
    length = lengths_ref[row]

    def num_blocks(length: Array) -> Array:
        return jnp.maximum(lax.div(length + block_tokens - 1, block_tokens), 1)

    def block_copies(row: Array, block: Array, slot: Array, wait: bool) -> None:
        """Starts (or waits for) the copies of the pages of `block` below the row's length."""
        first = block * pages_per_block
        filled = lax.div(lengths_ref[row] + page_size - 1, page_size)

        def page_copies(j: Array, carry: int) -> int:
            page = tables_ref[row * table_width + first + j]
            for source, destination in (
                (k_hbm.at[:, pl.ds(page, 1)], k_buffer.at[slot, :, pl.ds(j, 1)]),
                (v_hbm.at[:, pl.ds(page, 1)], v_buffer.at[slot, :, pl.ds(j, 1)]),
                (scales_hbm.at[pl.ds(page, 1)], scales_buffer.at[slot, lax.div(j, chunk), pl.ds(lax.rem(j, chunk), 1)]),
            ):
                copy = pltpu.make_async_copy(source, destination, semaphores.at[slot])
                if wait:
                    copy.wait()
                else:
                    copy.start()
            return carry

        lax.fori_loop(0, jnp.minimum(pages_per_block, filled - first), page_copies, 0)

    @pl.when((local_row == 0) & (block == 0))
    def _first_copy() -> None:
        slot_ref[0] = 0
        block_copies(row, block, jnp.int32(0), wait=False)

    last_block = block + 1 == num_blocks(length)

    @pl.when(block < num_blocks(length))
    def _step() -> None:
        slot = slot_ref[0]

        @pl.when(~last_block | (local_row + 1 < rows_per_core))
        def _next_copy() -> None:
            next_row = jnp.where(last_block, row + 1, row)
            next_block = jnp.where(last_block, 0, block + 1)
            block_copies(next_row, next_block, 1 - slot, wait=False)

        block_copies(row, block, slot, wait=True)
        slot_ref[0] = 1 - slot

        @pl.when(block == 0)
        def _init() -> None:
            max_scratch[...] = jnp.full(max_scratch.shape, MASK_VALUE, jnp.float32)
            sum_scratch[...] = jnp.zeros(sum_scratch.shape, jnp.float32)
            acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

        compute_dtype = q_ref.dtype
        filled = jnp.minimum(length - block * block_tokens, block_tokens)  # tokens of this block to attend
        num_chunks = lax.div(filled + chunk_tokens - 1, chunk_tokens)

        def attend_head(h: int) -> None:
            query = q_ref[h]
            key_lanes, value_lanes = pl.ds(2 * h * page_size, page_size), pl.ds((2 * h + 1) * page_size, page_size)

            def chunk_step(c: Array, state: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
                max_prev, total, acc = state
                pages = pl.ds(c * chunk, chunk)
                start = block * block_tokens + c * chunk_tokens
                visible = start + lax.broadcasted_iota(jnp.int32, (1, chunk_tokens), 1) < length
                keys = k_buffer[slot, h, pages].astype(compute_dtype).reshape(chunk_tokens, head_dim)
                logits = lax.dot_general(
                    query, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
                )
                key_scales = scales_buffer[slot, c, :, key_lanes].reshape(1, chunk_tokens)
                logits = jnp.where(visible, logits * (key_scales * sm_scale), MASK_VALUE)
                max_next = jnp.maximum(max_prev, jnp.max(logits, axis=1, keepdims=True))
                rescale = jnp.exp(max_prev - max_next)
                probs = jnp.where(visible, jnp.exp(logits - max_next[:, :1]), 0.0)
                total = rescale * total + jnp.sum(probs, axis=1, keepdims=True)
                value_scales = scales_buffer[slot, c, :, value_lanes].reshape(1, chunk_tokens)
                weights = jnp.where(visible, probs * value_scales, 0.0)
                values = v_buffer[slot, h, pages].astype(compute_dtype).reshape(chunk_tokens, head_dim)
                if jnp.issubdtype(v_buffer.dtype, jnp.floating):  # fp8 can hold NaN past the length
                    slots = start + lax.broadcasted_iota(jnp.int32, (chunk_tokens, 1), 0)
                    values = jnp.where(slots < length, values, 0)
                acc = rescale[:, :1] * acc + lax.dot_general(
                    weights.astype(compute_dtype),
                    values,
                    (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                    precision=precision,
                )
                return max_next, total, acc

            state = (max_scratch[h], sum_scratch[h], acc_scratch[h])
            max_scratch[h], sum_scratch[h], acc_scratch[h] = lax.fori_loop(0, num_chunks, chunk_step, state)

        for h in range(num_kv_heads):  # unrolled: each head's scales are static lane slices of the rows
            attend_head(h)

        @pl.when(last_block)
        def _finish() -> None:
            total = sum_scratch[...][:, :, :1]
            seen = total > 0  # False only for a row of length 0
            out_ref[...] = jnp.where(seen, acc_scratch[...] / jnp.where(seen, total, 1.0), 0.0).astype(out_ref.dtype)


def check_inputs(
    q: Array,
    k_pages: Array,
    v_pages: Array,
    scale_rows: Array,
    lengths: Array,
    page_indices: Array,
) -> None:
    """A ValueError naming the first input whose shape or dtype breaks the contract."""
    if q.ndim != 3 or q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q must be [S, Hq, hd] float32 or bfloat16, got {q.dtype} {q.shape}")
    rows, num_heads, head_dim = q.shape
    if k_pages.ndim != 4 or k_pages.shape[3] != head_dim or k_pages.dtype not in QUANTIZED_DTYPES:
        raise ValueError(
            f"k_pages must be int8 or float8_e4m3fn [Hkv, P, ps, {head_dim}], got {k_pages.dtype} {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"v_pages must match k_pages {k_pages.dtype} {k_pages.shape}, got {v_pages.dtype} {v_pages.shape}"
        )
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if scale_rows.shape != (num_pages, num_kv_heads * 2 * page_size) or scale_rows.dtype != jnp.float32:
        raise ValueError(
            f"scale_rows must be float32 [P, Hkv * 2 * ps] = [{num_pages}, {num_kv_heads * 2 * page_size}], "
            f"got {scale_rows.dtype} {scale_rows.shape}"
        )
    if num_heads % k_pages.shape[0]:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({k_pages.shape[0]})")
    if lengths.shape != (rows,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32 [{rows}], got {lengths.dtype} {lengths.shape}")
    if page_indices.ndim != 2 or page_indices.shape[0] != rows or page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices must be int32 [{rows}, W], got {page_indices.dtype} {page_indices.shape}")


def quantized_paged_attention(
    q: Float[Array, "S Hq hd"],
    k_pages: Shaped[Array, "Hkv P ps hd"],
    v_pages: Shaped[Array, "Hkv P ps hd"],
    scale_rows: Float[Array, "P Hkv_2_ps"],
    lengths: Int[Array, " S"],
    page_indices: Int[Array, "S W"],
    *,
    sm_scale: float,
    pages_per_block: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> Float[Array, "S Hq hd"]:
    """Decode attention, one query per row, over int8 / float8_e4m3fn pages with per-(token, kv
    head) float32 scales: out [S, Hq, hd] in q's dtype (bf16 or f32). scale_rows [P, Hkv * 2 * ps]:
    page p's key scales of head h at [p, 2 h ps : (2 h + 1) ps], its value scales right after.

    Row s attends its tokens 0 .. lengths[s] - 1 (int32, >= 1; 0 gives zeros), token i at page
    page_indices[s, i // ps], slot i % ps; table entries past ceil(lengths[s] / ps) are never read.
    `pages_per_block` defaults to `default_pages_per_block`. On TPU head_dim must be a multiple of
    128 (the lanes; other sizes would re-lay out the whole pool at every call). `interpret`: True
    (or `pltpu.InterpretParams`) runs Pallas' TPU interpreter on CPU.
    """
    check_inputs(q, k_pages, v_pages, scale_rows, lengths, page_indices)
    rows, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if not interpret and head_dim % LANES:
        raise ValueError(f"head_dim must be a multiple of {LANES} on TPU, got {head_dim}")
    group, table_width = num_heads // num_kv_heads, page_indices.shape[1]
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(
            table_width, page_size, num_kv_heads, group, head_dim, q.dtype.itemsize
        )
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
    cores = 2 if rows % 2 == 0 else 1  # megacore: each TensorCore takes half of the rows
    rows_per_core = rows // cores
    chunk = chunk_pages(pages_per_block, page_size)

    q_spec = pl.BlockSpec((None, num_kv_heads, group, head_dim), lambda c, r, i, *_: (c * rows_per_core + r, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    pages = (2, num_kv_heads, pages_per_block, page_size, head_dim)
    scales = (2, pages_per_block // chunk, chunk, num_kv_heads * 2 * page_size)
    kernel = functools.partial(
        _kernel,
        sm_scale=float(sm_scale),
        rows_per_core=rows_per_core,
        table_width=table_width,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT,
    )
    tokens = rows * table_width * page_size  # an upper bound: every table entry read
    cost = pl.CostEstimate(
        flops=4 * tokens * num_heads * head_dim,
        transcendentals=tokens * num_heads,
        bytes_accessed=tokens * num_kv_heads * 2 * (head_dim + 4) + 2 * q.size * q.dtype.itemsize,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(cores, rows_per_core, -(-table_width // pages_per_block)),
            in_specs=[q_spec, hbm, hbm, hbm],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM(pages, k_pages.dtype),
                pltpu.VMEM(pages, v_pages.dtype),
                pltpu.VMEM(scales, jnp.float32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((1,), jnp.int32),
                pltpu.VMEM((num_kv_heads, group, LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, group, LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, group, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((rows, num_kv_heads, group, head_dim), q.dtype),
        # The slot and the prefetched next block carry over from step to step within a core.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        cost_estimate=cost,
        name="quantized_paged_attention",
    )(
        lengths,
        page_indices.reshape(-1),
        q.reshape(rows, num_kv_heads, group, head_dim),
        k_pages,
        v_pages,
        scale_rows,
    )
    return out.reshape(rows, num_heads, head_dim)


def quantized_paged_attention_reference(
    q: Float[Array, "S Hq hd"],
    k_pages: Shaped[Array, "Hkv P ps hd"],
    v_pages: Shaped[Array, "Hkv P ps hd"],
    scale_rows: Float[Array, "P Hkv_2_ps"],
    lengths: Int[Array, " S"],
    page_indices: Int[Array, "S W"],
    *,
    sm_scale: float,
) -> Float[Array, "S Hq hd"]:
    """The oracle: gathers and dequantizes every row's pages in fp32, then a masked softmax."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    tokens = page_indices.shape[1] * page_size

    scales = scale_rows.reshape(-1, num_kv_heads, 2, page_size).transpose(2, 1, 0, 3)  # [k/v, Hkv, P, ps]

    def dequantized(pages: Array, scales: Array) -> Array:  # -> [S, Hkv, W * ps, hd] f32
        gathered = pages[:, page_indices].astype(jnp.float32) * scales[:, page_indices][..., None]
        return jnp.swapaxes(gathered, 0, 1).reshape(rows, num_kv_heads, tokens, head_dim)

    keys, values = dequantized(k_pages, scales[0]), dequantized(v_pages, scales[1])
    query = q.astype(jnp.float32).reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("shgd,shtd->shgt", query, keys, precision=lax.Precision.HIGHEST) * sm_scale
    visible = (jnp.arange(tokens) < lengths[:, None])[:, None, None, :]
    probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    values = jnp.where(visible[:, :, 0, :, None], values, 0.0)  # 0 * NaN past the length
    out = jnp.einsum("shgt,shtd->shgd", probs, values, precision=lax.Precision.HIGHEST)
    return out.reshape(rows, num_heads, head_dim).astype(q.dtype)


__all__ = [
    "check_inputs",
    "default_pages_per_block",
    "quantized_paged_attention",
    "quantized_paged_attention_reference",
    "vmem_bytes",
]
