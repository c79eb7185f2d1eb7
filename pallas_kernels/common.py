"""Input checks shared by every attention-with-concentration backend."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def check_attention_inputs(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    window_start: Int[Array, " B"] | Int[Array, "B L"] | None = None,
    segment_ids: Int[Array, "B L"] | None = None,
) -> tuple[int, int, int, int, int]:
    """Validates shapes/dtypes (window_start=None: attention without a concentration window; per row
    [B] or per query [B, L]; segment_ids None: one segment per row); returns (batch, length,
    num_heads, head_dim, num_kv_heads)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, L, Hq, D], got shape {q.shape}")
    batch, length, num_heads, head_dim = q.shape
    for name, tensor in (("k", k), ("v", v)):
        if tensor.ndim != 4 or tensor.shape[:2] != (batch, length) or tensor.shape[3] != head_dim:
            raise ValueError(
                f"{name} must be [B, L, Hkv, D] = [{batch}, {length}, Hkv, {head_dim}], got shape {tensor.shape}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    num_kv_heads = k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of k/v heads ({num_kv_heads})")
    if attention_mask.shape != (batch, length) or attention_mask.dtype != jnp.bool_:
        raise ValueError(
            f"attention_mask must be bool [B, L] = [{batch}, {length}], "
            f"got {attention_mask.dtype} {attention_mask.shape}"
        )
    if window_start is not None and (
        window_start.shape not in ((batch,), (batch, length)) or not jnp.issubdtype(window_start.dtype, jnp.integer)
    ):
        raise ValueError(
            f"window_start must be int [B] = [{batch}] or [B, L] = [{batch}, {length}], "
            f"got {window_start.dtype} {window_start.shape}"
        )
    if segment_ids is not None and (
        segment_ids.shape != (batch, length) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"segment_ids must be int [B, L] = [{batch}, {length}], got {segment_ids.dtype} {segment_ids.shape}"
        )
    return batch, length, num_heads, head_dim, num_kv_heads


def row_segments(attention_mask: Bool[Array, "B L"], segment_ids: Int[Array, "B L"] | None) -> Int[Array, "B L"]:
    """int32 segment ids [B, L]: `segment_ids`, or one segment (0) per row when None."""
    if segment_ids is None:
        return jnp.zeros(attention_mask.shape, jnp.int32)
    return segment_ids.astype(jnp.int32)


def query_window_start(window_start: Int[Array, " B"] | Int[Array, "B L"], length: int) -> Int[Array, "B L"]:
    """int32 window start per query [B, L] from one per row [B] or per query [B, L]."""
    window_start = window_start.astype(jnp.int32)
    if window_start.ndim == 1:
        return jnp.broadcast_to(window_start[:, None], (window_start.shape[0], length))
    return window_start


def segment_starts(segments: Int[Array, "B L"]) -> Int[Array, "B L"]:
    """int32 [B, L]: the first position of each query's segment (segments are contiguous runs)."""
    positions = jnp.arange(segments.shape[1], dtype=jnp.int32)[None]
    begins = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(begins, positions, 0), axis=1)


def block_minimum(per_query: Int[Array, "B L"], block: int, padded: int) -> Int[Array, "B N"]:
    """int32 [B, padded // block]: the minimum of `per_query` over each block of `block` queries (queries
    past L count as the row's last): the first key a blockwise kernel's query block can need."""
    extended = jnp.pad(per_query, ((0, 0), (0, padded - per_query.shape[1])), mode="edge")
    return extended.reshape(per_query.shape[0], padded // block, block).min(axis=2).astype(jnp.int32)


# A finite "minus infinity" for masked logits: exp() of it is 0 and max() of it never yields NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def cut_blocks(length: int, block_q: int, block_k: int, multiple: int) -> tuple[int, int]:
    """(block_q, block_k) cut to a row of `length` tokens rounded up to `multiple`, the key block (where
    cut) to a multiple of the query block, so the row pads to their lcm by less than one key block (cut
    to the row apart, lcm(128, 232) would pad a 230-token row to 3712)."""
    whole = round_up(length, multiple)
    block_q = min(block_q, whole)
    return block_q, min(block_k, round_up(whole, block_q))


def window_sizes(
    attention_mask: Bool[Array, "B L"], window_start: Int[Array, " B"] | Int[Array, "B L"]
) -> Int[Array, "B L"]:
    """n [B, L] int32: real keys in [window_start, p] for each query p (0 when p < window_start);
    window_start per row [B] or per query [B, L] (packed rows: at or after the query's segment start,
    so the window holds its own sequence's keys only).

    Computed from prefix counts of the mask, so no kernel needs to count keys.
    """
    window_start = query_window_start(window_start, attention_mask.shape[1])
    counts = jnp.cumsum(attention_mask.astype(jnp.int32), axis=1)  # real keys in [0, p]
    before = jnp.take_along_axis(counts, jnp.clip(window_start - 1, 0, attention_mask.shape[1] - 1), axis=1)
    before = jnp.where(window_start > 0, before, 0)  # real keys in [0, window_start)
    positions = jnp.arange(attention_mask.shape[1])[None]
    return jnp.where(positions >= window_start, counts - before, 0).astype(jnp.int32)


def causal_attention(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    *,
    sm_scale: float | None = None,
    segment_ids: Int[Array, "B L"] | None = None,
) -> Float[Array, "B L Hq D"]:
    """Plain causal GQA attention, `jax.nn.dot_product_attention` (XLA; cuDNN where it applies);
    with `segment_ids` a query sees only the keys of its own segment.

    The layers without concentration use it, and it supplies the gradient of the kernels' output.
    """
    length = q.shape[1]
    causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
    mask = causal[None, None] & attention_mask[:, None, None, :]
    if segment_ids is not None:
        mask &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=sm_scale)


# Optional per-token statistics of the same window distribution a_i (paper eq. herfindahl's
# head-averaged, window-renormalized attention), each from running sums over the window keys:
# "entropy" sum_i a_i log a_i, "max_weight" max_i a_i, "sink_herfindahl" the Herfindahl sums over
# the window without its first `sink_tokens` key positions. Herfindahl's own sums always run.
STATISTICS = ("entropy", "sink_herfindahl", "max_weight")
DEFAULT_SINK_TOKENS = 4  # StreamingLLM's count of attention-sink tokens
_PARTIALS = {"entropy": ("plogp",), "max_weight": ("peak",), "sink_herfindahl": ("sink_mass", "sink_square")}


# What every attention-with-concentration backend returns: (out [B, L, Hq, D], herfindahl [B, L] f32,
# window_size [B, L] int32), then the per-head LSE [B, Hq, L] f32 with `return_lse`, then
# {statistic: [B, L] f32} with a non-empty `statistics`.
ConcentrationOutputs = tuple[Array | dict[str, Array], ...]


def check_statistics(statistics: Iterable[str], sink_tokens: int) -> tuple[str, ...]:
    """`statistics` as a tuple of known names, or a ValueError naming the unknown one."""
    statistics = tuple(statistics)
    for name in statistics:
        if name not in STATISTICS:
            raise ValueError(
                f"unknown concentration statistic {name!r}; available: {STATISTICS} (herfindahl is always computed)"
            )
    if not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be a non-negative int, got {sink_tokens!r}")
    return statistics


def partial_names(statistics: Iterable[str]) -> tuple[str, ...]:
    """The running sums (and the running max "peak") the kernels keep per query for `statistics`."""
    return ("mass", "square") + tuple(name for statistic in statistics for name in _PARTIALS[statistic])


def window_partials(
    head_mean: Float[Array, "... K"],
    in_window: Bool[Array, "... K"],
    key_positions: Int[Array, "... K"],
    window_start: Array,
    statistics: Sequence[str],
    sink_tokens: int,
) -> dict[str, Float[Array, "... 1"]]:
    """Per-query partial sums over the last (key) axis of one block of head-mean probabilities
    (unnormalized over the window; keepdims), for `partial_names(statistics)`."""
    a = jnp.where(in_window, head_mean, 0.0)
    total = lambda x: jnp.sum(x, axis=-1, keepdims=True)
    partials = {"mass": total(a), "square": total(a * a)}
    if "entropy" in statistics:
        partials["plogp"] = total(jnp.where(a > 0, a * jnp.log(jnp.where(a > 0, a, 1.0)), 0.0))
    if "max_weight" in statistics:
        partials["peak"] = jnp.max(a, axis=-1, keepdims=True)
    if "sink_herfindahl" in statistics:
        beyond_sinks = jnp.where(key_positions >= window_start + sink_tokens, a, 0.0)
        partials["sink_mass"], partials["sink_square"] = total(beyond_sinks), total(beyond_sinks * beyond_sinks)
    return partials


def merge_partials(name: str, running: Array, block: Array) -> Array:
    """The running value of partial `name` after one more key block."""
    return jnp.maximum(running, block) if name == "peak" else running + block


def finish_statistics(partials: dict[str, Array], statistics: Sequence[str]) -> tuple[Array, dict[str, Array]]:
    """(herfindahl, {statistic: value}) from the partials over the whole window; 0 on an empty
    window. With the window mass M = sum_i m_i of the head-mean probabilities m_i, a_i = m_i / M:
    H = sum m^2 / M^2, entropy = -sum a log a = log M - sum m log m / M, max_weight = max m / M."""

    def herfindahl(mass: Array, square: Array) -> Array:
        has_window = mass > 0
        safe = jnp.where(has_window, mass, 1.0)
        return jnp.where(has_window, square / (safe * safe), 0.0)

    mass = partials["mass"]
    has_window = mass > 0
    safe_mass = jnp.where(has_window, mass, 1.0)
    values = {}
    if "entropy" in statistics:
        values["entropy"] = jnp.where(has_window, jnp.log(safe_mass) - partials["plogp"] / safe_mass, 0.0)
    if "sink_herfindahl" in statistics:
        values["sink_herfindahl"] = herfindahl(partials["sink_mass"], partials["sink_square"])
    if "max_weight" in statistics:
        values["max_weight"] = jnp.where(has_window, partials["peak"] / safe_mass, 0.0)
    return herfindahl(mass, partials["square"]), values
