"""Training attention: causal GQA attention with a backward pass that never materializes [L, L].

`training_attention(q, k, v, attention_mask, implementation=...)` takes q [B, L, Hq, D],
k / v [B, L, Hkv, D] and attention_mask [B, L] bool (False = padding, anywhere in the row) and
returns [B, L, Hq, D]: at every real query, softmax over the real keys at or before it. Outputs
at padded queries are finite but unspecified.

Packed rows (several sequences per row, the learner's sequence packing): `segment_ids` [B, L] int
gives each token its sequence, and a real query p sees key i iff i <= p, i is real and
segment_ids[p] == segment_ids[i]: every token gets what its sequence alone in a row would give it.
Segments are contiguous runs (the chunked path skips the key blocks before a query block's
earliest segment start); padding may carry any id (0, say), the mask already drops it. None (the
default) is one segment per row, the same computation as without the argument. Implementations:

- "xla": `pallas_kernels.common.causal_attention`, the materialized reference (small L only);
- "chunked": flash attention in plain XLA with a hand-written VJP (`chunked_attention`): memory
  O(block_q x block_k) per head, any platform; CPU's memory-efficient path (a sequence within one
  block skips the streaming: the softmax directly, heads leading);
- "splash": the Pallas TPU splash-attention kernel that ships with JAX, forward and backward
  (`splash_attention`); "splash_interpret" runs the same kernel interpreted (CPU tests). On packed
  rows it hands over to "packed_flash": splash skips blocks by a static mask only, so it would
  compute every causal block of a packed row;
- "packed_flash": our Mosaic flash attention, forward and backward, that skips the key blocks of
  earlier segments (`pallas_kernels.packed_attention`); "packed_flash_interpret" interpreted;
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` on GPU (`cudnn_attention`);
- "auto": splash on TPU, cudnn on GPU for 16-bit inputs, chunked otherwise.

The model picks one through `ModelConfig.attention` (config `model.attention`).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int

from comppo_jax.models.config import ATTENTION
from comppo_jax.sharding import BATCH, heads_axis, per_shard
from pallas_kernels.common import (
    MASK_VALUE,
    block_minimum,
    causal_attention,
    check_attention_inputs,
    round_up,
    segment_starts,
)

# Block edge of the chunked and splash paths (clipped to the padded length).
DEFAULT_BLOCK = 512


def resolve_implementation(implementation: str, dtype: DTypeLike, platform: str | None = None) -> str:
    """The concrete implementation "auto" stands for on `platform` (default: JAX's backend; a plan
    for another platform, like launch/plan.py's TPU compile from a CPU, resolves it first)."""
    if implementation not in ATTENTION:
        raise ValueError(f"attention implementation {implementation!r} is not available; expected one of {ATTENTION}")
    if implementation != "auto":
        return implementation
    platform = platform or jax.default_backend()
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda") and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "chunked"


def training_attention(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    *,
    implementation: str = "auto",
    sm_scale: float | None = None,
    block: int = DEFAULT_BLOCK,
    segment_ids: Int[Array, "B L"] | None = None,
) -> Float[Array, "B L Hq D"]:
    """Causal GQA attention over the real keys (of the query's own segment with `segment_ids`);
    see the module docstring for `implementation` and packed rows."""
    check_attention_inputs(q, k, v, attention_mask, segment_ids=segment_ids)
    chosen = resolve_implementation(implementation, q.dtype)
    if chosen == "xla":
        return causal_attention(q, k, v, attention_mask, sm_scale=sm_scale, segment_ids=segment_ids)
    if chosen == "chunked":
        return chunked_attention(
            q, k, v, attention_mask, sm_scale=sm_scale, block_q=block, block_k=block, segment_ids=segment_ids
        )
    if chosen == "cudnn":
        return cudnn_attention(q, k, v, attention_mask, sm_scale=sm_scale, segment_ids=segment_ids)
    if chosen.startswith("packed_flash") or segment_ids is not None:
        return packed_flash(
            q, k, v, attention_mask, segment_ids, sm_scale=sm_scale, interpret=chosen.endswith("_interpret")
        )
    return splash_attention(
        q,
        k,
        v,
        attention_mask,
        sm_scale=sm_scale,
        block=block,
        interpret=chosen == "splash_interpret",
        segment_ids=segment_ids,
    )


def _scale(sm_scale: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if sm_scale is None else sm_scale


# --- chunked: flash attention in XLA -----------------------------------------------------------


def _pad_length(x: Array, length: int, value: bool | int = 0) -> Array:
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def chunked_attention(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    *,
    sm_scale: float | None = None,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    segment_ids: Int[Array, "B L"] | None = None,
) -> Float[Array, "B L Hq D"]:
    """Flash attention (online softmax over key blocks) in plain XLA, with a blockwise VJP.

    Query blocks are mapped one after another; each visits only the key blocks at or before
    its diagonal, and with `segment_ids` (packed rows, contiguous segments) only those from the
    one holding the earliest segment start of its queries (over the batch) on. The forward keeps
    the per-row log-sum-exp; the backward recomputes each [block_q, block_k] probability block
    from it (FlashAttention-2's recurrences: dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
    dQ = dS K, dK = dS^T Q), one pass for dQ and one for dK, dV, over the same block pairs.
    A query with no real key at or before it (left padding) gets the mean of the masked values and
    no gradient; its output is unspecified anyway, and the model never reads it.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    block_q, block_k = min(block_q, round_up(length, 8)), min(block_k, round_up(length, 8))
    padded = round_up(length, np.lcm(block_q, block_k))
    if padded == block_q == block_k:  # one block: nothing to stream, the softmax directly
        return _one_block_attention(q, k, v, attention_mask, _scale(sm_scale, head_dim), segment_ids=segment_ids)
    grouped = lambda x: _pad_length(x, padded).reshape(batch, padded, num_kv, num_heads // num_kv, head_dim)
    # The padding continues the last segment (its keys are masked), so segment starts stay monotone.
    segments = (
        None
        if segment_ids is None
        else jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded - length)), mode="edge")
    )
    out = _flash(
        grouped(q),
        _pad_length(k, padded),
        _pad_length(v, padded),
        _pad_length(attention_mask, padded, False),
        segments,
        _scale(sm_scale, head_dim),
        block_q,
        block_k,
    )
    return out.reshape(batch, padded, num_heads, head_dim)[:, :length]


def _one_block_attention(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    scale: float,
    query_slices: int = 2,
    segment_ids: Int[Array, "B L"] | None = None,
) -> Float[Array, "B L Hq D"]:
    """Causal GQA softmax attention over all of L at once (the [L, L] block flash would hold),
    heads leading: each (row, kv head) is one contiguous [G * l, D] x [D, keys] matmul, which XLA
    runs faster on CPU than the token-major einsums of the blocked path. The queries go in
    `query_slices` static slices, each over the keys up to its last query: the first half of the
    queries never computes the (masked) second half of the keys. With `segment_ids` a query sees only
    its own segment's keys."""
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    groups = num_heads // num_kv
    q_heads = q.reshape(batch, length, num_kv, groups, head_dim).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, L, D]
    k_heads, v_heads = jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2)  # [B, Hkv, L, D]
    bounds = sorted({length * i // query_slices for i in range(query_slices + 1)})  # no empty slice when L < slices
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        rows = q_heads[:, :, :, lo:hi].reshape(batch, num_kv, groups * (hi - lo), head_dim)
        logits = jnp.einsum("bhqd,bhkd->bhqk", rows, k_heads[:, :, :hi], preferred_element_type=jnp.float32) * scale
        q_pos = jnp.tile(jnp.arange(lo, hi), groups)
        visible = (q_pos[:, None] >= jnp.arange(hi)[None, :])[None, None] & attention_mask[:, None, None, :hi]
        if segment_ids is not None:  # rows are (group, query) like q_pos
            q_seg = jnp.tile(segment_ids[:, lo:hi], (1, groups))
            visible = visible & (q_seg[:, :, None] == segment_ids[:, None, :hi])[:, None]
        probs = jax.nn.softmax(jnp.where(visible, logits, MASK_VALUE), axis=-1)
        out = jnp.einsum(
            "bhqk,bhkd->bhqd", probs.astype(v.dtype), v_heads[:, :, :hi], preferred_element_type=jnp.float32
        )
        outs.append(out.reshape(batch, num_kv, groups, hi - lo, head_dim))
    return jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype)


def _block_logits(
    q_block: Float[Array, "B bq Hkv G D"],
    k_block: Float[Array, "B bk Hkv D"],
    key_mask_block: Bool[Array, "B bk"],
    q_segments: Int[Array, "B bq"] | None,
    k_segments: Int[Array, "B bk"] | None,
    q_start: int | Array,
    k_start: int | Array,
    scale: float,
) -> tuple[Float[Array, "B Hkv G bq bk"], Bool[Array, "B 1 1 bq bk"]]:
    """Scaled logits [B, Hkv, G, bq, bk] (float32) with causal, padding and (segments given)
    same-segment masks applied."""
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q_block, k_block, preferred_element_type=jnp.float32) * scale
    q_pos = q_start + jnp.arange(q_block.shape[1])
    k_pos = k_start + jnp.arange(k_block.shape[1])
    visible = (q_pos[:, None] >= k_pos[None, :])[None, None, None] & key_mask_block[:, None, None, None, :]
    if q_segments is not None and k_segments is not None:
        visible = visible & (q_segments[:, :, None] == k_segments[:, None, :])[:, None, None]
    return jnp.where(visible, logits, MASK_VALUE), visible


def _slice(x: Array, start: int | Array, size: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _unblock(blocks: Array) -> Array:
    """[n, B, block, ...] stacked by `lax.map` -> [B, n * block, ...]."""
    return jnp.moveaxis(blocks, 0, 1).reshape((blocks.shape[1], -1) + blocks.shape[3:])


def _last_key_block(q_start: int | Array, block_q: int, block_k: int) -> Array:
    """Number of key blocks at or before the diagonal of the query block starting at q_start."""
    return jax.lax.div(q_start + block_q - 1, block_k) + 1


def _first_key_blocks(segments: Int[Array, "B Lp"] | None, block_q: int, block_k: int) -> Int[Array, " nq"] | None:
    """Per query block, the key block holding the earliest segment start of its queries over the
    batch (None without segments: key block 0). Segment starts never decrease along a row, so
    neither does this; query block i visits key blocks [first[i], its diagonal], and key block j is
    visited by the query blocks from its diagonal up to the last i with first[i] <= j."""
    if segments is None:
        return None
    return block_minimum(segment_starts(segments), block_q, segments.shape[1]).min(axis=0) // block_k


def _segment_slice(segments: Array | None, start: int | Array, size: int) -> Array | None:
    return None if segments is None else _slice(segments, start, size)


def _flash_forward(
    q: Float[Array, "B Lp Hkv G D"],
    k: Float[Array, "B Lp Hkv D"],
    v: Float[Array, "B Lp Hkv D"],
    key_mask: Bool[Array, "B Lp"],
    segments: Int[Array, "B Lp"] | None,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[Float[Array, "B Lp Hkv G D"], Float[Array, "B Hkv G Lp"]]:
    """(out [B, Lp, Hkv, G, D] in q's dtype, lse [B, Hkv, G, Lp] float32)."""
    batch, padded, num_kv, groups, head_dim = q.shape
    first_key_blocks = _first_key_blocks(segments, block_q, block_k)

    def query_block(i: Array) -> tuple[Array, Array]:
        q_start = i * block_q
        q_block = _slice(q, q_start, block_q)
        q_segments = _segment_slice(segments, q_start, block_q)
        stats_shape = (batch, num_kv, groups, block_q)

        def key_block(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            row_max, row_sum, acc = carry
            k_start = j * block_k
            logits, _ = _block_logits(
                q_block,
                _slice(k, k_start, block_k),
                _slice(key_mask, k_start, block_k),
                q_segments,
                _segment_slice(segments, k_start, block_k),
                q_start,
                k_start,
                scale,
            )
            new_max = jnp.maximum(row_max, logits.max(-1))
            probs = jnp.exp(logits - new_max[..., None])
            correction = jnp.exp(row_max - new_max)
            acc = acc * correction[..., None] + jnp.einsum(
                "bhgqk,bkhd->bhgqd",
                probs.astype(v.dtype),
                _slice(v, k_start, block_k),
                preferred_element_type=jnp.float32,
            )
            return new_max, row_sum * correction + probs.sum(-1), acc

        init = (
            jnp.full(stats_shape, MASK_VALUE, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (head_dim,), jnp.float32),
        )
        first = 0 if first_key_blocks is None else first_key_blocks[i]
        row_max, row_sum, acc = jax.lax.fori_loop(first, _last_key_block(q_start, block_q, block_k), key_block, init)
        out = (acc / row_sum[..., None]).astype(q.dtype)  # [B, Hkv, G, bq, D]
        return out.transpose(0, 3, 1, 2, 4), row_max + jnp.log(row_sum)

    out, lse = jax.lax.map(query_block, jnp.arange(padded // block_q))  # [nq, B, bq, Hkv, G, D], [nq, B, Hkv, G, bq]
    return _unblock(out), lse.transpose(1, 2, 3, 0, 4).reshape(batch, num_kv, groups, padded)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(
    q: Array, k: Array, v: Array, key_mask: Array, segments: Array | None, scale: float, block_q: int, block_k: int
) -> Array:
    return _flash_forward(q, k, v, key_mask, segments, scale, block_q, block_k)[0]


_Residuals = tuple[Array, Array, Array, Array, Array | None, Array, Array]


def _flash_fwd(
    q: Array, k: Array, v: Array, key_mask: Array, segments: Array | None, scale: float, block_q: int, block_k: int
) -> tuple[Array, _Residuals]:
    out, lse = _flash_forward(q, k, v, key_mask, segments, scale, block_q, block_k)
    return out, (q, k, v, key_mask, segments, out, lse)


def _flash_bwd(
    scale: float, block_q: int, block_k: int, residuals: _Residuals, d_out: Array
) -> tuple[Array, Array, Array, None, None]:
    """dq, dk, dv over the same (query block, key block) pairs the forward visited; the mask and
    the segment ids get no cotangent."""
    q, k, v, key_mask, segments, out, lse = residuals
    batch, padded, num_kv, groups, head_dim = q.shape
    # rowsum(dO * O) per query row: the softmax Jacobian's diagonal correction.
    d_sum = jnp.einsum("bqhgd,bqhgd->bhgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    first_key_blocks = _first_key_blocks(segments, block_q, block_k)

    def probs_and_dlogits(q_start: Array, k_start: Array) -> tuple[Array, Array, Array, Array]:
        """P and dS of one [bq, bk] block, recomputed from the saved LSE."""
        q_block = _slice(q, q_start, block_q)
        logits, visible = _block_logits(
            q_block,
            _slice(k, k_start, block_k),
            _slice(key_mask, k_start, block_k),
            _segment_slice(segments, q_start, block_q),
            _segment_slice(segments, k_start, block_k),
            q_start,
            k_start,
            scale,
        )
        lse_block = jax.lax.dynamic_slice_in_dim(lse, q_start, block_q, axis=3)
        probs = jnp.where(visible, jnp.exp(logits - lse_block[..., None]), 0.0)
        d_out_block = _slice(d_out, q_start, block_q)
        d_probs = jnp.einsum(
            "bqhgd,bkhd->bhgqk", d_out_block, _slice(v, k_start, block_k), preferred_element_type=jnp.float32
        )
        d_sum_block = jax.lax.dynamic_slice_in_dim(d_sum, q_start, block_q, axis=3)
        return probs, probs * (d_probs - d_sum_block[..., None]), q_block, d_out_block

    def dq_block(i: Array) -> Array:
        q_start = i * block_q

        def key_block(j: Array, d_q: Array) -> Array:
            k_start = j * block_k
            _, d_logits, _, _ = probs_and_dlogits(q_start, k_start)
            return d_q + jnp.einsum(
                "bhgqk,bkhd->bqhgd",
                d_logits.astype(k.dtype),
                _slice(k, k_start, block_k),
                preferred_element_type=jnp.float32,
            )

        d_q = jax.lax.fori_loop(
            0 if first_key_blocks is None else first_key_blocks[i],
            _last_key_block(q_start, block_q, block_k),
            key_block,
            jnp.zeros((batch, block_q, num_kv, groups, head_dim), jnp.float32),
        )
        return (d_q * scale).astype(q.dtype)

    def dkv_block(j: Array) -> tuple[Array, Array]:
        k_start = j * block_k

        def query_block(i: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
            d_k, d_v = carry
            probs, d_logits, q_block, d_out_block = probs_and_dlogits(i * block_q, k_start)
            d_v = d_v + jnp.einsum(
                "bhgqk,bqhgd->bkhd", probs.astype(v.dtype), d_out_block, preferred_element_type=jnp.float32
            )
            d_k = d_k + jnp.einsum(
                "bhgqk,bqhgd->bkhd", d_logits.astype(q.dtype), q_block, preferred_element_type=jnp.float32
            )
            return d_k, d_v

        zeros = jnp.zeros((batch, block_k, num_kv, head_dim), jnp.float32)
        # The query blocks that visited key block j in the forward: first[i] <= j, a prefix of them.
        stop = padded // block_q if first_key_blocks is None else jnp.sum(first_key_blocks <= j, dtype=jnp.int32)
        d_k, d_v = jax.lax.fori_loop(jax.lax.div(k_start, block_q), stop, query_block, (zeros, zeros))
        return (d_k * scale).astype(k.dtype), d_v.astype(v.dtype)

    d_q = _unblock(jax.lax.map(dq_block, jnp.arange(padded // block_q)))
    d_k, d_v = jax.lax.map(dkv_block, jnp.arange(padded // block_k))
    return d_q, _unblock(d_k), _unblock(d_v), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --- cudnn: jax.nn.dot_product_attention on packed rows ---------------------------------------


def cudnn_attention(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    *,
    sm_scale: float | None = None,
    implementation: Literal["xla", "cudnn"] = "cudnn",
    segment_ids: Int[Array, "B L"] | None = None,
) -> Float[Array, "B L Hq D"]:
    """`jax.nn.dot_product_attention(is_causal=True)` with each row's real tokens packed first.

    cuDNN's fused kernel takes causal masking and per-row key lengths, not an arbitrary padding
    mask, so the real tokens of each row are moved (stably) to the front, attended with
    `key_value_seq_lengths`, and moved back. RoPE is applied before, so positions are unaffected.
    `implementation="xla"` runs the same packing on any platform (how the tests check it).

    With `segment_ids` (packed rows) that trick does not apply: one length per row cannot say
    where each sequence starts, and the segment-packed layout of cuDNN's kernel (q/kv offsets) is
    not reachable through `jax.nn.dot_product_attention`. So the whole visibility (causal, real key,
    same segment) goes in as an explicit [B, 1, L, L] mask, which the cuDNN path turns into an
    additive bias: correct, but it holds an [L, L] tensor per row like the "xla" reference.
    """
    if segment_ids is not None:
        length = q.shape[1]
        causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
        same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = (causal[None] & attention_mask[:, None, :] & same_segment)[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=sm_scale, implementation=implementation)
    order = jnp.argsort(~attention_mask, axis=1, stable=True)  # real tokens first, in order
    inverse = jnp.argsort(order, axis=1)
    take = lambda x, index: jnp.take_along_axis(x, index[:, :, None, None], axis=1)
    lengths = jnp.maximum(
        attention_mask.sum(axis=1, dtype=jnp.int32), 1
    )  # an all-padding row must not reach cuDNN empty
    packed = jax.nn.dot_product_attention(
        take(q, order),
        take(k, order),
        take(v, order),
        scale=sm_scale,
        is_causal=True,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )
    return take(packed, inverse)


# --- packed_flash: our Pallas TPU kernel for packed rows ----------------------------------------


def packed_flash(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    segment_ids: Int[Array, "B L"] | None,
    *,
    sm_scale: float | None = None,
    interpret: bool = False,
) -> Float[Array, "B L Hq D"]:
    """`pallas_kernels.packed_attention.packed_flash_attention` (forward and backward skip the key
    blocks of earlier segments), run per shard under a context mesh like splash: batch over (data,
    fsdp), heads over `tensor` where it divides them."""
    from pallas_kernels.packed_attention import packed_flash_attention

    segments = jnp.zeros(attention_mask.shape, jnp.int32) if segment_ids is None else segment_ids
    heads = P(BATCH, None, heads_axis(q.shape[2], k.shape[2]), None)
    rows = P(BATCH, None)
    attend = lambda q, k, v, mask, segments: packed_flash_attention(
        q, k, v, mask, segments, sm_scale=sm_scale, interpret=interpret
    )
    return per_shard(attend, in_specs=(heads, heads, heads, rows, rows), out_specs=heads)(
        q, k, v, attention_mask, segments
    )


# --- splash: the Pallas TPU kernel --------------------------------------------------------------


def splash_attention(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    *,
    sm_scale: float | None = None,
    block: int = DEFAULT_BLOCK,
    interpret: bool = False,
    segment_ids: Int[Array, "B L"] | None = None,
) -> Float[Array, "B L Hq D"]:
    """JAX's Pallas splash attention (TPU), forward and backward, padding as segment ids.

    Real tokens are segment 1 and padding segment 0, so a real query sees exactly the real keys
    at or before it; with `segment_ids` (packed rows) real tokens are segment_ids + 1, so it sees
    the real keys of its own sequence (the kernel masks by segment inside the blocks it visits,
    it does not skip blocks by segment). The length is padded to a multiple of the block. Under a
    context mesh the kernel runs per shard (`comppo_jax.sharding.per_shard`): batch over
    (data, fsdp), heads over `tensor` where it divides them.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    batch, length, num_heads, head_dim = q.shape
    block = min(block, round_up(length, 128))
    padded = round_up(length, block)
    heads_first = lambda x: _pad_length(x, padded).transpose(0, 2, 1, 3)  # [B, H, Lp, D]
    q = heads_first(q * jnp.asarray(_scale(sm_scale, head_dim), q.dtype))
    k, v = heads_first(k), heads_first(v)
    if segment_ids is None:
        segments = _pad_length(attention_mask, padded, False).astype(jnp.int32)
    else:
        segments = _pad_length(jnp.where(attention_mask, segment_ids.astype(jnp.int32) + 1, 0), padded)
    sizes: dict[str, Any] = dict.fromkeys(
        [
            "block_q",
            "block_kv",
            "block_kv_compute",
            "block_q_dkv",
            "block_kv_dkv",
            "block_kv_dkv_compute",
            "block_q_dq",
            "block_kv_dq",
        ],
        block,
    )

    def local(q: Array, k: Array, v: Array, segments: Int[Array, "B Lp"]) -> Array:
        mask = splash.MultiHeadMask([splash.CausalMask((padded, padded))] * q.shape[1])
        kernel = splash.make_splash_mha(
            mask, block_sizes=splash.BlockSizes(**sizes), head_shards=1, q_seq_shards=1, interpret=interpret
        )
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s)))(q, k, v, segments)

    rows = P(BATCH, heads_axis(num_heads, k.shape[1]), None, None)
    out = per_shard(local, in_specs=(rows, rows, rows, P(BATCH, None)), out_specs=rows)(q, k, v, segments)
    return out.transpose(0, 2, 1, 3)[:, :length]
