"""Materialized attention with per-token concentration: the test oracle (small L only).

Definitions (docs/conventions.md, "The concentration window"; paper eq. herfindahl): for the query at position p,
`a_pi` is the attention probability on key i averaged over all query heads, restricted to
the window keys i in [window_start, p] that are real tokens, and renormalized there;
`H_p = sum_i a_pi^2` and `n_p` is the number of window keys. Where the window is empty
(p < window_start) H is 0 and n is 0; a query with no visible key at all gets a zero output.
Packed rows (`segment_ids`): a query sees only the keys of its own segment, and its window start
(per query) lies at or after its segment's start, so H and n are its own sequence's.
The optional statistics (`pallas_kernels.common.STATISTICS`) are of the same a_pi.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import (
    DEFAULT_SINK_TOKENS,
    ConcentrationOutputs,
    check_attention_inputs,
    check_statistics,
    finish_statistics,
    query_window_start,
    row_segments,
    window_partials,
)


def attention_with_concentration_reference(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    v: Float[Array, "B L Hkv D"],
    attention_mask: Bool[Array, "B L"],
    window_start: Int[Array, " B"] | Int[Array, "B L"],
    *,
    sm_scale: float | None = None,
    return_lse: bool = False,
    statistics: Sequence[str] = (),
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    segment_ids: Int[Array, "B L"] | None = None,
) -> ConcentrationOutputs:
    """Causal GQA attention that materializes the [L, L] probabilities.

    q [B, L, Hq, D]; k, v [B, L, Hkv, D]; attention_mask [B, L] bool; window_start [B] or [B, L]
    int32; segment_ids [B, L] int or None (one segment per row).
    Returns (out [B, L, Hq, D] in q's dtype, herfindahl [B, L] f32, window_size [B, L] int32),
    plus the per-head log-sum-exp [B, Hq, L] f32 (0 where no key is visible) with `return_lse`,
    plus {statistic: [B, L] f32} for a non-empty `statistics`.
    """
    statistics = check_statistics(statistics, sink_tokens)
    batch, length, num_heads, head_dim, num_kv_heads = check_attention_inputs(
        q, k, v, attention_mask, window_start, segment_ids
    )
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    positions = jnp.arange(length)
    segments = row_segments(attention_mask, segment_ids)
    window_start = query_window_start(window_start, length)[:, :, None]  # [B, Lq, 1]
    allowed = (
        (positions[:, None] >= positions[None, :])[None]
        & attention_mask[:, None, :]
        & (segments[:, :, None] == segments[:, None, :])
    )  # [B, Lq, Lk]

    grouped_q = q.reshape(batch, length, num_kv_heads, group, head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped_q, k, preferred_element_type=jnp.float32) * scale
    # finfo.min rather than -inf: a query with no visible key (left padding) gets a finite row.
    logits = jnp.where(allowed[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    # A query with no visible key (left padding) gets a zero output, as in the blockwise kernels.
    out = jnp.where(allowed.any(-1)[:, :, None, None], out.reshape(batch, length, num_heads, head_dim), 0.0).astype(
        q.dtype
    )

    in_window = allowed & (positions[None, None, :] >= window_start)
    partials = window_partials(
        probs.mean(axis=(1, 2)), in_window, positions[None, None, :], window_start, statistics, sink_tokens
    )
    herfindahl, values = finish_statistics({name: x[..., 0] for name, x in partials.items()}, statistics)
    outputs: ConcentrationOutputs = (out, herfindahl, in_window.sum(-1).astype(jnp.int32))
    if return_lse:
        lse = jax.nn.logsumexp(logits, axis=-1).reshape(batch, num_heads, length)
        outputs += (jnp.where(allowed.any(-1)[:, None, :], lse, 0.0),)
    return outputs + (values,) if statistics else outputs
