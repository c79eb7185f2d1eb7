"""Paged KV cache: one pool of fixed-size pages for every layer and sequence, read through page tables.

A sequence's page table [max_pages] lists its logical pages in order: token i lives on page
`table[i // page_size]` at offset `i % page_size`, and its length says how many tokens are filled.
Layer l's logical page p is physical page `l * pages_per_layer + p`, so one table serves every
layer and no layer is ever sliced out of the pool (a slice would copy it at each step).

Where a mesh's tensor axis is a larger multiple of the kv head count, the pool keeps each kv head
`sharding.kv_head_repeat` times so that the heads still split over `tensor` (`fit_heads`).

Pool layouts (`LAYOUTS`, per backend), K and V apart unless said otherwise:
- "heads_first" (XLA path and GPU kernel): [Hkv, num_layers * pages, page_size, hd], as
  `jax.experimental.pallas.ops.gpu.paged_attention` reads it; gathered pages come out
  [Hkv, S, n, page_size, hd], i.e. each (kv head, row)'s keys contiguous for one matmul;
- "combined" (TPU kernel): one array [num_layers * pages, page_size, 2 * Hkv, hd], keys at even
  and values at odd kv-head slots, as `jax.experimental.pallas.ops.tpu.ragged_paged_attention`
  reads it.

Decode attention (one query per sequence) reads only the filled pages:
- "xla": reads the first `num_pages` pages of every table (the engine passes, traced, what the
  longest live sequence needs, so a step costs what the lengths need, not what `max_new_tokens`
  allows) in chunks of `XLA_CHUNK_TOKENS`, with an online softmax across chunks, and masks past
  each length; any platform, CPU's path;
- "tpu" / "tpu_interpret": the TPU ragged paged attention kernel, compiled or interpreted;
- "gpu" / "gpu_interpret": the Pallas GPU paged attention kernel, compiled (Triton) or interpreted;
- "auto": tpu on TPU (head_dim a multiple of 128, else xla), gpu on GPU, xla otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from comppo_jax.sharding import BATCH, context_platform, heads_axis, per_shard
from pallas_kernels.common import MASK_VALUE

PAGED_ATTENTION = ("auto", "xla", "tpu", "tpu_interpret", "gpu", "gpu_interpret")
LAYOUTS = {
    "xla": "heads_first",
    "tpu": "combined",
    "tpu_interpret": "combined",
    "gpu": "heads_first",
    "gpu_interpret": "heads_first",
}
PAGE_AXIS = {"combined": 0, "heads_first": 1}  # the (layer, page) axis of each array
KV_BLOCK_BYTES = 4 << 20  # the TPU kernel's double-buffered key/value block in VMEM
# Tokens per XLA-path chunk: a chunk's gathered keys and values (a few MiB at 16 rows) stay in
# cache between the gather and the two matmuls; gathering every page at once writes a fresh
# buffer of the whole live cache per layer, which took half the attention's time on CPU.
XLA_CHUNK_TOKENS = 256


def resolve_paged_attention(backend: str, head_dim: int, platform: str | None = None) -> str:
    """The concrete paged-attention backend "auto" stands for on `platform` (default: the one
    being compiled for, `sharding.context_platform`).

    The TPU kernel lays a head's features along the 128 lanes, so it needs head_dim % 128 == 0;
    "auto" takes the XLA path for other head sizes (small test models).
    """
    if backend not in PAGED_ATTENTION:
        raise ValueError(f"paged attention backend {backend!r} is not available; expected one of {PAGED_ATTENTION}")
    if backend.startswith("tpu") and head_dim % 128:
        raise ValueError(
            f"paged attention backend {backend!r} needs head_dim % 128 == 0 (the TPU kernel's lanes), "
            f"got head_dim={head_dim}; use 'xla' or 'auto'"
        )
    if backend != "auto":
        return backend
    platform = platform or context_platform()
    if platform == "tpu":
        return "tpu" if head_dim % 128 == 0 else "xla"
    return "gpu" if platform in ("gpu", "cuda") else "xla"


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["arrays"], meta_fields=["layout", "pages_per_layer", "page_size"]
)
@dataclasses.dataclass(frozen=True)
class PagePool:
    """The pool's arrays ((k, v), or (kv,) combined) in `layout`; the sizes are static."""

    arrays: tuple[Array, ...]
    layout: str
    pages_per_layer: int
    page_size: int

    def with_arrays(self, *arrays: Array) -> PagePool:
        return dataclasses.replace(self, arrays=arrays)

    @property
    def page_axis(self) -> int:
        return PAGE_AXIS[self.layout]


def empty_pool(
    num_layers: int,
    pages_per_layer: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: DTypeLike,
    backend: str,
) -> PagePool:
    total, layout = num_layers * pages_per_layer, LAYOUTS[backend]
    shape = {
        "heads_first": (num_kv_heads, total, page_size, head_dim),
        "combined": (total, page_size, 2 * num_kv_heads, head_dim),
    }[layout]
    return PagePool(
        tuple(jnp.zeros(shape, dtype) for _ in range(1 if layout == "combined" else 2)),
        layout,
        pages_per_layer,
        page_size,
    )


def _as_layout(layout: str, k: Float[Array, "*rows Hkv hd"], v: Float[Array, "*rows Hkv hd"]) -> tuple[Array, ...]:
    """Per-token rows k, v [..., Hkv, hd] -> what one token occupies in each pool array."""
    if layout == "combined":
        return (jnp.stack([k, v], axis=-2).reshape(k.shape[:-2] + (-1, k.shape[-1])),)  # k/v interleaved
    return k, v


def fit_heads(pool: PagePool, x: Float[Array, "*rows Hkv hd"]) -> Float[Array, "*rows pool_Hkv hd"]:
    """Keys or values x [..., Hkv, hd] with each head repeated to the pool's kv heads: a pool split
    over more devices than there are kv heads keeps each head `sharding.kv_head_repeat` times."""
    repeat, remainder = divmod(num_kv_heads(pool), x.shape[-2])
    if remainder:
        raise ValueError(
            f"the page pool has {num_kv_heads(pool)} kv heads, not a multiple of the {x.shape[-2]} written"
        )
    return x if repeat == 1 else jnp.repeat(x, repeat, axis=-2)


def write_tokens(
    pool: PagePool,
    layer: int | Int[Array, ""],
    pages: Int[Array, " S"],
    offsets: Int[Array, " S"],
    k: Float[Array, "S Hkv hd"],
    v: Float[Array, "S Hkv hd"],
) -> PagePool:
    """Writes one token per row: k, v [S, Hkv, hd] at logical `pages` [S], `offsets` [S] of `layer`."""
    physical = layer * pool.pages_per_layer + pages
    values = _as_layout(pool.layout, fit_heads(pool, k), fit_heads(pool, v))
    if pool.layout == "combined":
        index = lambda a: a.at[physical, offsets]
    else:
        index = lambda a: a.at[:, physical, offsets]
        values = tuple(jnp.swapaxes(x, 0, 1) for x in values)  # [Hkv, S, hd]
    return pool.with_arrays(*(index(a).set(x.astype(a.dtype)) for a, x in zip(pool.arrays, values)))


def write_pages(
    pool: PagePool, first_page: int, k: Float[Array, "N n page_size Hkv hd"], v: Float[Array, "N n page_size Hkv hd"]
) -> PagePool:
    """Writes whole pages for every layer: k, v [N, n, page_size, Hkv, hd] to logical pages
    [first_page, first_page + n) (a static range: the prompts' pages). Token by token, with the
    decode steps' own scatter, so the pool keeps one layout (the TPU kernel's) from the start."""
    count, page_size = k.shape[1], k.shape[2]
    pages = jnp.repeat(first_page + jnp.arange(count), page_size)
    offsets = jnp.tile(jnp.arange(page_size), count)
    tokens = lambda x: x.reshape((count * page_size,) + x.shape[2:])
    for layer in range(k.shape[0]):
        pool = write_tokens(pool, layer, pages, offsets, tokens(k[layer]), tokens(v[layer]))
    return pool


def copy_pages(pool: PagePool, source: Int[Array, " S"], destination: Int[Array, " S"]) -> PagePool:
    """Copies logical pages `source` [S] to `destination` [S] in every layer (copy-on-write), one
    page at a time in place (a gather of pages can make XLA re-lay out the whole pool)."""
    layers = pool.arrays[0].shape[pool.page_axis] // pool.pages_per_layer
    offsets = jnp.arange(layers)[:, None] * pool.pages_per_layer
    src, dst = (offsets + source[None]).reshape(-1), (offsets + destination[None]).reshape(-1)

    def copy_one(i: Array, arrays: tuple[Array, ...]) -> tuple[Array, ...]:
        page = lambda a: jax.lax.dynamic_slice_in_dim(a, src[i], 1, pool.page_axis)
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, page(a), dst[i], pool.page_axis) for a in arrays)

    return pool.with_arrays(*jax.lax.fori_loop(0, src.shape[0], copy_one, pool.arrays))


def pool_specs(pool: PagePool, num_heads: int) -> tuple[P, ...]:
    """PartitionSpecs of shard-stacked pool arrays [D, ...]: D over the batch axes, kv heads over
    `tensor` when it divides both head counts (as the query heads are split)."""
    heads = heads_axis(num_heads, num_kv_heads(pool))
    spec = {"combined": P(BATCH, None, None, heads, None), "heads_first": P(BATCH, heads, None, None, None)}[
        pool.layout
    ]
    return (spec,) * len(pool.arrays)


def num_kv_heads(pool: PagePool) -> int:
    shape = pool.arrays[0].shape
    return {"heads_first": shape[-4], "combined": shape[-2] // 2}[pool.layout]


def decode_attention(
    q: Float[Array, "S Hq hd"],
    pool: PagePool,
    layer: int | Int[Array, ""],
    tables: Int[Array, "S max_pages"],
    lengths: Int[Array, " S"],
    *,
    backend: str,
    num_pages: int | Int[Array, ""] | None = None,
    sm_scale: float | None = None,
) -> Float[Array, "S Hq hd"]:
    """One query per sequence over its filled pages: q [S, Hq, hd] -> [S, Hq, hd].

    tables [S, max_pages] int32 logical pages; lengths [S] int32 tokens to attend (>= 1, the
    current token's key already written). `num_pages` (XLA path; may be traced) bounds the pages
    read per row, default the whole table.
    """
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    physical = tables + layer * pool.pages_per_layer
    if backend == "xla":
        k_and_v = cast("tuple[Array, Array]", pool.arrays)  # the XLA path's layout: heads_first, (k, v)
        return _xla_decode_attention(
            q, *k_and_v, physical, lengths, tables.shape[1] if num_pages is None else num_pages, scale
        )
    if backend in ("tpu", "tpu_interpret"):
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

        rows = q.shape[0]
        # Block sizes from a VMEM budget (the kernel's fallback, 128 pages, can exceed v5e's 16 MiB scoped VMEM).
        kv = pool.arrays[0]
        page_bytes = kv[0].size * kv.dtype.itemsize
        kv_pages_per_block = max(1, min(physical.shape[1], KV_BLOCK_BYTES // (2 * page_bytes)))
        attend: Callable[..., Array] = functools.partial(
            rpa.ragged_paged_attention,
            sm_scale=scale,
            num_kv_pages_per_block=kv_pages_per_block,
            num_queries_per_block=min(rows, 32),
        )
        if backend == "tpu_interpret":
            attend = _interpret(attend)
        return attend(
            q, pool.arrays[0], lengths, physical, jnp.arange(rows + 1, dtype=jnp.int32), jnp.full((1,), rows, jnp.int32)
        )
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    # The kernel splits each table into k_splits partitions of whole compute blocks.
    k_splits = _largest_divisor(physical.shape[1], 16)
    k_pool, v_pool = pool.arrays
    return gpu_paged.paged_attention(
        q * jnp.asarray(scale, q.dtype),
        k_pool,
        v_pool,
        physical,
        lengths,
        k_splits=k_splits,
        pages_per_compute_block=_largest_divisor(physical.shape[1] // k_splits, 8),
        interpret=backend == "gpu_interpret",
    )


def sharded_decode_attention(
    q: Float[Array, "D S Hq hd"],
    pool: PagePool,
    layer: int | Int[Array, ""],
    tables: Int[Array, "D S W"],
    lengths: Int[Array, "D S"],
    *,
    backend: str,
    num_pages: int | Int[Array, ""] | None = None,
) -> Float[Array, "D S Hq hd"]:
    """`decode_attention` for shard-stacked inputs: q [D, S, Hq, hd], pool arrays [D, ...], tables
    [D, S, W], lengths [D, S]; shard d's rows read shard d's pool. Under a mesh each device runs its
    own shards (`sharding.per_shard`): D over the batch axes, heads over `tensor` where it divides them."""
    rows = P(BATCH, None, heads_axis(q.shape[2], num_kv_heads(pool)), None)

    num_pages = tables.shape[-1] if num_pages is None else num_pages

    def local(
        q: Array,
        arrays: tuple[Array, ...],
        layer: int | Array,
        tables: Array,
        lengths: Array,
        num_pages: int | Array,
    ) -> Array:
        def one(q: Array, arrays: tuple[Array, ...], tables: Array, lengths: Array) -> Array:
            return decode_attention(
                q, pool.with_arrays(*arrays), layer, tables, lengths, backend=backend, num_pages=num_pages
            )

        if backend == "xla":
            return jax.vmap(one)(q, arrays, tables, lengths)
        # A Pallas kernel per local shard (usually one per device).
        return jnp.stack([one(q[d], tuple(a[d] for a in arrays), tables[d], lengths[d]) for d in range(q.shape[0])])

    specs = (rows, pool_specs(pool, q.shape[2]), P(), P(BATCH), P(BATCH), P())
    return per_shard(local, in_specs=specs, out_specs=rows)(q, pool.arrays, layer, tables, lengths, num_pages)


def _interpret(attend: Callable[..., Array]) -> Callable[..., Array]:
    """The TPU kernel under Pallas' TPU interpreter (CPU tests)."""
    from jax.experimental.pallas import tpu as pltpu

    def run(*args: Any) -> Array:
        with pltpu.force_tpu_interpret_mode():
            return attend(*args)

    return run


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def _xla_decode_attention(
    q: Float[Array, "S Hq hd"],
    k_pool: Float[Array, "Hkv P page_size hd"],
    v_pool: Float[Array, "Hkv P page_size hd"],
    physical: Int[Array, "S W"],
    lengths: Int[Array, " S"],
    num_pages: int | Int[Array, ""],
    scale: float,
) -> Float[Array, "S Hq hd"]:
    """Heads-first pages, `chunk` at a time: each chunk gathers to [Hkv, S, chunk * page_size, hd],
    so each (kv head, row) is one batch entry of both matmuls and nothing is transposed; an online
    softmax (running peak, total and output) combines the ceil(num_pages / chunk) chunks."""
    rows, num_heads, head_dim = q.shape
    num_kv, page_size = k_pool.shape[0], k_pool.shape[2]
    groups = num_heads // num_kv
    chunk = max(1, min(XLA_CHUNK_TOKENS // page_size, physical.shape[1]))
    chunks = -(-physical.shape[1] // chunk)
    physical = jnp.pad(physical, ((0, 0), (0, chunks * chunk - physical.shape[1])))  # padding is masked
    query = jnp.swapaxes(q.reshape(rows, num_kv, groups, head_dim), 0, 1)  # [Hkv, S, G, hd]
    span = chunk * page_size

    def attend_chunk(i: int | Array) -> tuple[Array, Array, Array]:
        """(peak [Hkv, S, G], total, unnormalized output [Hkv, S, G, hd]) of chunk i alone."""
        pages = jax.lax.dynamic_slice_in_dim(physical, i * chunk, chunk, axis=1)
        k, v = (pool[:, pages].reshape(num_kv, rows, span, head_dim) for pool in (k_pool, v_pool))
        logits = jnp.einsum("hstd,hsgd->hstg", k, query, preferred_element_type=jnp.float32) * scale
        visible = i * span + jnp.arange(span)[None] < lengths[:, None]  # [S, span]
        logits = jnp.where(visible[None, :, :, None], logits, MASK_VALUE)
        peak = logits.max(axis=2)
        weights = jnp.exp(logits - peak[:, :, None])
        out = jnp.einsum("hstg,hstd->hsgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return peak, weights.sum(axis=2), out

    def add_chunk(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        # A chunk past a row's length has peak MASK_VALUE, so its weight below is 0.
        (peak, total, out), (chunk_peak, chunk_total, chunk_out) = carry, attend_chunk(i)
        new_peak = jnp.maximum(peak, chunk_peak)
        old, new = jnp.exp(peak - new_peak), jnp.exp(chunk_peak - new_peak)
        return new_peak, total * old + chunk_total * new, out * old[..., None] + chunk_out * new[..., None]

    # Every row sees position 0, so chunk 0 always has a real peak.
    _, total, out = (
        jax.lax.fori_loop(1, -(-num_pages // chunk), add_chunk, attend_chunk(0)) if chunks > 1 else attend_chunk(0)
    )
    return jnp.swapaxes(out / total[..., None], 0, 1).reshape(rows, num_heads, head_dim).astype(q.dtype)
