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

8-bit pages (`kv_dtype` int8 or float8_e4m3fn, comppo_jax.models.quantize): each token's key and
value in each kv head are stored with a float32 scale, keys and values heads-first as above: half
the bytes of bfloat16 pages (plus 4 bytes per token and kv head for each scale), written at
prefill and at each decode step. Decode attention multiplies the key scale into the logits and
the value scale into the probabilities. The scales' layout (`QUANTIZED_LAYOUTS`):
- "scale_rows" (XLA path, TPU kernel): one row per page, `scales` = ([num_layers * pages,
  Hkv * 2 * page_size],): each kv head's key scales, then its value scales. A token's write
  rewrites its 4-token group's words (`PACKED_TOKENS`) and its page's whole scale row, one written
  row after another: on TPU a scatter of single tokens' bytes or scales, or a gather of every
  written row at once, makes XLA re-tile the whole array (every layer's) for the write and copy it
  back for the kernel, at every layer of every step;
- "heads_first" (GPU kernel): `scales` = (k, v) [Hkv, num_layers * pages, page_size], as
  `jax.experimental.pallas.ops.gpu.paged_attention` reads them.

Decode attention (one query per sequence) reads only the filled pages:
- "xla": reads the first `num_pages` pages of every table (the engine passes, traced, what the
  longest live sequence needs, so a step costs what the lengths need, not what `max_new_tokens`
  allows) in chunks of `XLA_CHUNK_TOKENS`, with an online softmax across chunks, and masks past
  each length; any platform, CPU's path;
- "tpu" / "tpu_interpret": the TPU ragged paged attention kernel, compiled or interpreted (8-bit
  pages: `pallas_kernels.quantized_paged_attention`, which reads the per-token scales);
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
from jaxtyping import Array, Float, Int, Shaped

from comppo_jax.models.quantize import LARGEST, quantize
from comppo_jax.sharding import BATCH, context_platform, heads_axis, per_shard
from pallas_kernels.common import MASK_VALUE

PAGED_ATTENTION = ("auto", "xla", "tpu", "tpu_interpret", "gpu", "gpu_interpret")
KV_DTYPES = ("auto", "float32", "bfloat16", "int8", "float8_e4m3fn")  # "auto": the compute dtype
LAYOUTS = {
    "xla": "heads_first",
    "tpu": "combined",
    "tpu_interpret": "combined",
    "gpu": "heads_first",
    "gpu_interpret": "heads_first",
}
QUANTIZED_LAYOUTS = {backend: "heads_first" if backend.startswith("gpu") else "scale_rows" for backend in LAYOUTS}
PAGE_AXIS = {"combined": 0, "heads_first": 1, "scale_rows": 1}  # the (layer, page) axis of each page array
SCALE_PAGE_AXIS = {"heads_first": 1, "scale_rows": 0}  # ... and of each scale array
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


def kv_dtype(name: str, compute_dtype: DTypeLike) -> str:
    """The pages' dtype `rollout.kv_dtype` names ("auto": the compute dtype)."""
    if name not in KV_DTYPES:
        raise ValueError(f"kv dtype {name!r} is not one of {KV_DTYPES}")
    return jnp.dtype(compute_dtype).name if name == "auto" else name


def pool_layout(backend: str, dtype: str) -> str:
    """The pool layout `backend` reads pages of `dtype` in (module docstring)."""
    return QUANTIZED_LAYOUTS[backend] if dtype in LARGEST else LAYOUTS[backend]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["arrays", "scales"],
    meta_fields=["layout", "pages_per_layer", "page_size"],
)
@dataclasses.dataclass(frozen=True)
class PagePool:
    """The pool's arrays ((k, v), or (kv,) combined) in `layout`, and for 8-bit pages their float32
    scales in `layout` (module docstring; empty otherwise); the sizes are static."""

    arrays: tuple[Array, ...]
    layout: str
    pages_per_layer: int
    page_size: int
    scales: tuple[Array, ...] = ()

    def with_arrays(self, *arrays: Array, scales: tuple[Array, ...] | None = None) -> PagePool:
        return dataclasses.replace(self, arrays=arrays, scales=self.scales if scales is None else scales)

    @property
    def page_axis(self) -> int:
        return PAGE_AXIS[self.layout]

    @property
    def quantized(self) -> str | None:
        """The 8-bit format of the pages, or None."""
        name = self.arrays[0].dtype.name
        return name if name in LARGEST else None


def empty_pool(
    num_layers: int,
    pages_per_layer: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: DTypeLike,
    backend: str,
) -> PagePool:
    """A zeroed pool of pages in `dtype` (8-bit: with zero scales) in `backend`'s layout."""
    total, name = num_layers * pages_per_layer, jnp.dtype(dtype).name
    layout = pool_layout(backend, name)
    shape = {
        "heads_first": (num_kv_heads, total, page_size, head_dim),
        "scale_rows": (num_kv_heads, total, page_size, head_dim),
        "combined": (total, page_size, 2 * num_kv_heads, head_dim),
    }[layout]
    scales: tuple[Array, ...] = ()
    if layout == "scale_rows":
        scales = (jnp.zeros((total, num_kv_heads * 2 * page_size), jnp.float32),)
    elif name in LARGEST:
        scales = (jnp.zeros(shape[:-1], jnp.float32),) * 2
    return PagePool(
        tuple(jnp.zeros(shape, dtype) for _ in range(1 if layout == "combined" else 2)),
        layout,
        pages_per_layer,
        page_size,
        scales,
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
    """Writes one token per row: k, v [S, Hkv, hd] at logical `pages` [S], `offsets` [S] of `layer`
    (8-bit pages: quantized per token and kv head, with their scales)."""
    physical = layer * pool.pages_per_layer + pages
    values = _as_layout(pool.layout, fit_heads(pool, k), fit_heads(pool, v))
    if pool.layout == "combined":
        index = lambda a: a.at[physical, offsets]
    else:
        index = lambda a: a.at[:, physical, offsets]
        values = tuple(jnp.swapaxes(x, 0, 1) for x in values)  # [Hkv, S, hd]
    if pool.quantized is None:
        return pool.with_arrays(*(index(a).set(x.astype(a.dtype)) for a, x in zip(pool.arrays, values)))
    stored = [quantize(x, pool.quantized, axis=-1) for x in values]
    arrays = tuple(_write_in_groups(a, physical, offsets, x) for a, (x, _) in zip(pool.arrays, stored))
    if pool.layout == "heads_first":
        return pool.with_arrays(*arrays, scales=tuple(index(a).set(s) for a, (_, s) in zip(pool.scales, stored)))
    # Scale rows: each row's page row read, its token's key and value scales set, written back, one
    # row after another (a gather of all rows at once makes XLA re-tile the whole array for it).
    new = jnp.stack([s.T for _, s in stored], axis=-1)  # [S, Hkv, k/v]

    def write_row(row: int, rows: Array) -> Array:
        old = jax.lax.dynamic_slice_in_dim(rows, physical[row], 1, 0).reshape(new.shape[1:] + (pool.page_size,))
        updated = jnp.where(jnp.arange(pool.page_size) == offsets[row], new[row][..., None], old)
        return jax.lax.dynamic_update_slice_in_dim(rows, updated.reshape(1, -1), physical[row], 0)

    return pool.with_arrays(*arrays, scales=(jax.lax.fori_loop(0, len(pages), write_row, pool.scales[0], unroll=True),))


# 8-bit tokens a 32-bit word holds along a page (a TPU tile packs consecutive rows).
PACKED_TOKENS = 4


def _write_in_groups(
    pages: Shaped[Array, "Hkv P page_size hd"], physical: Int[Array, " S"], offsets: Int[Array, " S"], x: Array
) -> Shaped[Array, "Hkv P page_size hd"]:
    """`pages` with x [Hkv, S, hd] at (physical, offsets), each token written with the rest of its
    group of `PACKED_TOKENS` (read, the token set, written back: whole 32-bit words) where the page
    size allows. On TPU a scatter of single tokens' bytes makes XLA re-tile the whole pool for the
    write and copy it back for the kernel at every layer of every step."""
    group = PACKED_TOKENS if pages.shape[2] % PACKED_TOKENS == 0 else 1
    rows = (offsets // group * group)[:, None] + jnp.arange(group)  # [S, group]
    heads = jnp.arange(pages.shape[0])[:, None, None]
    at = pages.at[heads, physical[:, None], rows]
    words = jnp.where((rows == offsets[:, None])[..., None], x[:, :, None], pages[heads, physical[:, None], rows])
    return at.set(words)


def write_pages(
    pool: PagePool, first_page: int, k: Float[Array, "N n page_size Hkv hd"], v: Float[Array, "N n page_size Hkv hd"]
) -> PagePool:
    """Writes whole pages for every layer: k, v [N, n, page_size, Hkv, hd] to logical pages
    [first_page, first_page + n) (a static range: the prompts' pages). Float pages token by token,
    with the decode steps' own scatter, so the pool keeps one layout (the TPU kernel's) from the
    start; 8-bit pages (whole words and scale rows) as one slice per layer."""
    count, page_size = k.shape[1], k.shape[2]
    if pool.quantized:
        for layer in range(k.shape[0]):
            pool = _write_8bit_pages(pool, layer * pool.pages_per_layer + first_page, k[layer], v[layer])
        return pool
    pages = jnp.repeat(first_page + jnp.arange(count), page_size)
    offsets = jnp.tile(jnp.arange(page_size), count)
    tokens = lambda x: x.reshape((count * page_size,) + x.shape[2:])
    for layer in range(k.shape[0]):
        pool = write_tokens(pool, layer, pages, offsets, tokens(k[layer]), tokens(v[layer]))
    return pool


def _write_8bit_pages(
    pool: PagePool, first: int, k: Float[Array, "n page_size Hkv hd"], v: Float[Array, "n page_size Hkv hd"]
) -> PagePool:
    """k, v quantized into physical pages [first, first + n) of an 8-bit pool, with their scales."""
    heads_first = lambda x: jnp.moveaxis(fit_heads(pool, x), 2, 0)  # [Hkv, n, page_size, hd]
    dtype = cast(str, pool.quantized)
    (k_pages, k_scales), (v_pages, v_scales) = (quantize(heads_first(x), dtype, axis=-1) for x in (k, v))
    put = lambda a, x, axis: jax.lax.dynamic_update_slice_in_dim(a, x, first, axis)
    arrays = tuple(put(a, x, 1) for a, x in zip(pool.arrays, (k_pages, v_pages)))
    if pool.layout == "heads_first":
        return pool.with_arrays(*arrays, scales=tuple(put(a, x, 1) for a, x in zip(pool.scales, (k_scales, v_scales))))
    rows = jnp.stack([k_scales, v_scales], axis=1)  # [Hkv, k/v, n, page_size]
    rows = jnp.moveaxis(rows, 2, 0).reshape(k.shape[0], -1)  # [n, Hkv * 2 * page_size]
    return pool.with_arrays(*arrays, scales=(put(pool.scales[0], rows, 0),))


def copy_pages(pool: PagePool, source: Int[Array, " S"], destination: Int[Array, " S"]) -> PagePool:
    """Copies logical pages `source` [S] to `destination` [S] in every layer (copy-on-write), one
    page at a time in place (a gather of pages can make XLA re-lay out the whole pool)."""
    layers = pool.arrays[0].shape[pool.page_axis] // pool.pages_per_layer
    offsets = jnp.arange(layers)[:, None] * pool.pages_per_layer
    src, dst = (offsets + source[None]).reshape(-1), (offsets + destination[None]).reshape(-1)
    arrays = pool.arrays + pool.scales
    axes = (pool.page_axis,) * len(pool.arrays) + (SCALE_PAGE_AXIS.get(pool.layout, 0),) * len(pool.scales)

    def copy_one(i: Array, arrays: tuple[Array, ...]) -> tuple[Array, ...]:
        page = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, src[i], 1, axis)
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(a, page(a, axis), dst[i], axis) for a, axis in zip(arrays, axes)
        )

    copied = jax.lax.fori_loop(0, src.shape[0], copy_one, arrays)
    return pool.with_arrays(*copied[: len(pool.arrays)], scales=copied[len(pool.arrays) :])


def pool_specs(pool: PagePool, num_heads: int) -> tuple[P, ...]:
    """PartitionSpecs of shard-stacked pool arrays [D, ...]: D over the batch axes, kv heads over
    `tensor` when it divides both head counts (as the query heads are split)."""
    heads = heads_axis(num_heads, num_kv_heads(pool))
    spec = {"combined": P(BATCH, None, None, heads, None)}.get(pool.layout, P(BATCH, heads, None, None, None))
    return (spec,) * len(pool.arrays)


def scale_specs(pool: PagePool, num_heads: int) -> tuple[P, ...]:
    """PartitionSpecs of shard-stacked scales, split over kv heads as the pages: [D, Hkv, pages,
    page_size], or [D, pages, Hkv * 2 * page_size] rows (each head's scales contiguous)."""
    heads = heads_axis(num_heads, num_kv_heads(pool))
    spec = P(BATCH, None, heads) if pool.layout == "scale_rows" else P(BATCH, heads, None, None)
    return (spec,) * len(pool.scales)


def num_kv_heads(pool: PagePool) -> int:
    shape = pool.arrays[0].shape
    return shape[-2] // 2 if pool.layout == "combined" else shape[-4]


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
            q, *k_and_v, pool.scales, physical, lengths, tables.shape[1] if num_pages is None else num_pages, scale
        )
    if backend in ("tpu", "tpu_interpret") and pool.quantized:
        from pallas_kernels.quantized_paged_attention import quantized_paged_attention

        (k_pages, v_pages), (scale_rows,) = pool.arrays, pool.scales
        interpret = backend == "tpu_interpret"
        return quantized_paged_attention(
            q, k_pages, v_pages, scale_rows, lengths, physical, sm_scale=scale, interpret=interpret
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

    # The kernel splits each table into k_splits partitions of whole compute blocks; Triton loads a
    # compute block's page numbers as one array, whose size must be a power of two.
    k_splits = _largest_divisor(physical.shape[1], 16)
    k_pool, v_pool = pool.arrays
    scales: tuple[Array | None, ...] = pool.scales or (None, None)
    return gpu_paged.paged_attention(
        q * jnp.asarray(scale, q.dtype),
        k_pool,
        v_pool,
        physical,
        lengths,
        k_scales_pages=scales[0],
        v_scales_pages=scales[1],
        k_splits=k_splits,
        pages_per_compute_block=_largest_power_of_two_divisor(physical.shape[1] // k_splits, 8),
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
        scales: tuple[Array, ...],
        layer: int | Array,
        tables: Array,
        lengths: Array,
        num_pages: int | Array,
    ) -> Array:
        def one(q: Array, arrays: tuple[Array, ...], scales: tuple[Array, ...], tables: Array, lengths: Array) -> Array:
            return decode_attention(
                q,
                pool.with_arrays(*arrays, scales=scales),
                layer,
                tables,
                lengths,
                backend=backend,
                num_pages=num_pages,
            )

        if backend == "xla":
            return jax.vmap(one)(q, arrays, scales, tables, lengths)
        # A Pallas kernel per local shard (usually one per device).
        shard = lambda arrays, d: tuple(a[d] for a in arrays)
        return jnp.stack(
            [one(q[d], shard(arrays, d), shard(scales, d), tables[d], lengths[d]) for d in range(q.shape[0])]
        )

    specs = (rows, pool_specs(pool, q.shape[2]), scale_specs(pool, q.shape[2]), P(), P(BATCH), P(BATCH), P())
    return per_shard(local, in_specs=specs, out_specs=rows)(
        q, pool.arrays, pool.scales, layer, tables, lengths, num_pages
    )


def _interpret(attend: Callable[..., Array]) -> Callable[..., Array]:
    """The TPU kernel under Pallas' TPU interpreter (CPU tests)."""
    from jax.experimental.pallas import tpu as pltpu

    def run(*args: Any) -> Array:
        with pltpu.force_tpu_interpret_mode():
            return attend(*args)

    return run


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def _largest_power_of_two_divisor(n: int, at_most: int) -> int:
    return max(d for d in (1, 2, 4, 8, 16, 32) if d <= at_most and n % d == 0)


def _xla_decode_attention(
    q: Float[Array, "S Hq hd"],
    k_pool: Float[Array, "Hkv P page_size hd"],
    v_pool: Float[Array, "Hkv P page_size hd"],
    scales: tuple[Array, ...],
    physical: Int[Array, "S W"],
    lengths: Int[Array, " S"],
    num_pages: int | Int[Array, ""],
    scale: float,
) -> Float[Array, "S Hq hd"]:
    """Heads-first pages, `chunk` at a time: each chunk gathers to [Hkv, S, chunk * page_size, hd],
    so each (kv head, row) is one batch entry of both matmuls and nothing is transposed; an online
    softmax (running peak, total and output) combines the ceil(num_pages / chunk) chunks. 8-bit
    pages: their scale rows [P, Hkv * 2 * page_size] multiply the logits and the probabilities."""
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
        k, v = (pool[:, pages].reshape(num_kv, rows, span, head_dim).astype(q.dtype) for pool in (k_pool, v_pool))
        logits = jnp.einsum("hstd,hsgd->hstg", k, query, preferred_element_type=jnp.float32) * scale
        if scales:  # [Hkv, S, span, 1]: the key's scale on its logits
            per_page = scales[0][pages].reshape(rows, chunk, num_kv, 2, page_size)
            k_scale, v_scale = (
                jnp.moveaxis(per_page[:, :, :, part], 2, 0).reshape(num_kv, rows, span, 1) for part in (0, 1)
            )
            logits = logits * k_scale
        visible = i * span + jnp.arange(span)[None] < lengths[:, None]  # [S, span]
        logits = jnp.where(visible[None, :, :, None], logits, MASK_VALUE)
        peak = logits.max(axis=2)
        weights = jnp.exp(logits - peak[:, :, None])
        total = weights.sum(axis=2)
        if scales:  # the value's scale on its probability
            weights = weights * v_scale
        out = jnp.einsum("hstg,hstd->hsgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return peak, total, out

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
