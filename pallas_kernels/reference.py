"""Materialized attention with per-token concentration: the test oracle (small L only).

Definitions (../shared/DESIGN.md, paper eq. herfindahl): for the query at position p,
`a_pi` is the attention probability on key i averaged over all query heads, restricted to
the window keys i in [window_start, p] that are real tokens, and renormalized there;
`H_p = sum_i a_pi^2` and `n_p` is the number of window keys. Where the window is empty
(p < window_start) H is 0 and n is 0; a query with no visible key at all gets a zero output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import check_attention_inputs


def attention_with_concentration_reference(q, k, v, attention_mask, window_start, *, sm_scale=None, return_lse=False):
    """Causal GQA attention that materializes the [L, L] probabilities.

    q [B, L, Hq, D]; k, v [B, L, Hkv, D]; attention_mask [B, L] bool; window_start [B] int32.
    Returns (out [B, L, Hq, D] in q's dtype, herfindahl [B, L] f32, window_size [B, L] int32),
    plus the per-head log-sum-exp [B, Hq, L] f32 (0 where no key is visible) with `return_lse`.
    """
    batch, length, num_heads, head_dim, num_kv_heads = check_attention_inputs(q, k, v, attention_mask, window_start)
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    positions = jnp.arange(length)
    allowed = (positions[:, None] >= positions[None, :])[None] & attention_mask[:, None, :]  # [B, Lq, Lk]

    grouped_q = q.reshape(batch, length, num_kv_heads, group, head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped_q, k, preferred_element_type=jnp.float32) * scale
    # finfo.min rather than -inf: a query with no visible key (left padding) gets a finite row.
    logits = jnp.where(allowed[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    # A query with no visible key (left padding) gets a zero output, as in the blockwise kernels.
    out = jnp.where(allowed.any(-1)[:, :, None, None], out.reshape(batch, length, num_heads, head_dim), 0.0).astype(q.dtype)

    in_window = allowed & (positions[None, None, :] >= window_start[:, None, None])
    head_mean = jnp.where(in_window, probs.mean(axis=(1, 2)), 0.0)
    mass = head_mean.sum(-1)
    window_size = in_window.sum(-1).astype(jnp.int32)
    herfindahl = jnp.where(window_size > 0, jnp.square(head_mean).sum(-1) / jnp.square(jnp.where(mass > 0, mass, 1.0)), 0.0)
    if not return_lse:
        return out, herfindahl, window_size
    lse = jax.nn.logsumexp(logits, axis=-1).reshape(batch, num_heads, length)
    return out, herfindahl, window_size, jnp.where(allowed.any(-1)[:, None, :], lse, 0.0)
