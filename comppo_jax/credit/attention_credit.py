"""Attention-anchor credit: GRPO's advantage amplified on the tokens that later tokens keep attending to.

Li et al. 2025, "Attention Illuminates LLM Reasoning: The Preplan-and-Anchor Rhythm Enables Fine-Grained
Policy Optimization" (arXiv 2510.13554, ICML 2026), strategy (2) of section 5.2, "global-anchor credit":

    FAI_s  = 1 / |T(s)| sum_{t in T(s)} A_{t,s},   T(s) = {t in R : s + H_lo <= t <= s + H_hi}   (Def. 4.2)
    T_glob = TopQ(FAI, q)                                                         (eq. 16; v1: eq. 15)
    A~_t   = gamma_t A_t,   gamma_t = 1 + (gamma_amp - 1) 1{t in T_glob}          (eqs. 13, 17; v1: 12, 16)

with A_t GRPO's group-relative advantage (eq. 6) and R the response's positions; the paper's defaults
q = 0.4, gamma_amp = 1.5, H_lo = 10, H_hi = 100 (v1: 50), gamma applied to the signed advantage.

A_{t,s} here is the final layer's causal attention probability of the query at position t on the key at s,
averaged over all its query heads: the attention the scoring pass already reads for the gate. The paper
averages instead over the 30% of heads with the longest attention span, in five layers of the middle third
of the network (section 5.1); the scoring pass keeps only the final layer's queries and keys.
`future_attention_influence` computes FAI blockwise from those queries, keys and the per-head log-sum-exp
the concentration kernel returns, as `comppo_jax.critic.window_topk` does: no [L, L] array is formed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from comppo_jax.credit import _validation
from comppo_jax.credit.advantages import grpo_advantages
from pallas_kernels.common import query_window_start, round_up, row_segments

INFLUENCE_BLOCK = 128  # keys per step of the blockwise pass


@functools.partial(jax.jit, static_argnames=("horizon", "block", "sm_scale"))
def future_attention_influence(
    q: Float[Array, "B L Hq D"],
    k: Float[Array, "B L Hkv D"],
    lse: Float[Array, "B Hq L"],
    attention_mask: Bool[Array, "B L"],
    response_start: Int[Array, " B"] | Int[Array, "B L"],
    *,
    horizon: tuple[int, int],
    segment_ids: Int[Array, "B L"] | None = None,
    block: int = INFLUENCE_BLOCK,
    sm_scale: float | None = None,
) -> Float[Array, "B L"]:
    """FAI_s [B, L] of every key position s (Li et al. 2025, Def. 4.2), float32, 0 where T(s) is empty.

    FAI_s = 1/|T(s)| sum_{t in T(s)} a_ts, T(s) the response positions t of s's sequence with
    H_lo <= t - s <= H_hi (`horizon` = (H_lo, H_hi)); a_ts = mean_h exp(scale q_t^h . k_s^h - lse_t^h),
    the causal attention probability averaged over the query heads. q [B, L, Hq, D], k [B, L, Hkv, D]
    (after norm and RoPE), lse [B, Hq, L]: the final layer's (`comppo_jax.models.forward`'s
    FinalAttention). response_start: each sequence's first response position, per row [B] or per query
    [B, L] (packed rows, with their `segment_ids`: a query only counts for keys of its own segment).

    Key block by key block: the queries within the horizon of a block of `block` keys are the
    block + H_hi - H_lo from its first key + H_lo, so each step holds one [Hq, block + H_hi - H_lo, block]
    tile of probabilities.
    """
    lo, hi = horizon
    if not 0 <= lo <= hi:
        raise ValueError(f"horizon must be (H_lo, H_hi) with 0 <= H_lo <= H_hi, got {horizon}")
    batch, length, num_heads, head_dim = q.shape
    if k.shape[:2] != (batch, length) or num_heads % k.shape[2] or lse.shape != (batch, num_heads, length):
        raise ValueError(
            f"q [B, L, Hq, D], k [B, L, Hkv, D], lse [B, Hq, L] expected, got {q.shape}, {k.shape}, {lse.shape}"
        )
    group = num_heads // k.shape[2]
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    block = min(block, round_up(length, 8))
    padded = round_up(length, block)
    span = block + hi - lo
    positions = jnp.arange(length)[None]
    segments = row_segments(attention_mask, segment_ids)
    # A query counts when it is a real response token (R); its segment decides whose keys it counts for.
    counted = attention_mask & (positions >= query_window_start(response_start, length))
    # The last key block reads queries up to padded + H_hi: zero padding, never counted.
    tail = lambda x, axis, size: jnp.pad(x, [(0, size - length if a == axis else 0) for a in range(x.ndim)])
    q = tail(q, 1, padded + hi).reshape(batch, padded + hi, -1, group, head_dim)
    lse = tail(lse.astype(jnp.float32), 2, padded + hi).reshape(batch, -1, group, padded + hi)
    counted, query_segments = tail(counted, 1, padded + hi), tail(segments, 1, padded + hi)
    k, key_mask, key_segments = tail(k, 1, padded), tail(attention_mask, 1, padded), tail(segments, 1, padded)

    def key_block(index: Array) -> tuple[Array, Array]:  # (sum over T(s) of a_ts, |T(s)|) [B, bk] of a key block
        first_key = index * block
        first_query = first_key + lo
        k_tile = lax.dynamic_slice_in_dim(k, first_key, block, 1)  # [B, bk, Hkv, D]
        q_tile = lax.dynamic_slice_in_dim(q, first_query, span, 1)  # [B, span, Hkv, g, D]
        lse_tile = lax.dynamic_slice_in_dim(lse, first_query, span, 3)  # [B, Hkv, g, span]
        logits = jnp.einsum("bqhgd,bkhd->bhgqk", q_tile, k_tile, preferred_element_type=jnp.float32) * scale
        distance = (first_query + jnp.arange(span))[:, None] - (first_key + jnp.arange(block))[None]
        in_horizon = (
            ((distance >= lo) & (distance <= hi))[None]
            & lax.dynamic_slice_in_dim(counted, first_query, span, 1)[:, :, None]
            & lax.dynamic_slice_in_dim(key_mask, first_key, block, 1)[:, None, :]
            & (
                lax.dynamic_slice_in_dim(query_segments, first_query, span, 1)[:, :, None]
                == lax.dynamic_slice_in_dim(key_segments, first_key, block, 1)[:, None, :]
            )
        )  # [B, span, bk]
        probs = jnp.exp(jnp.where(in_horizon[:, None, None], logits - lse_tile[..., None], -jnp.inf))
        return probs.mean(axis=(1, 2)).sum(axis=1), in_horizon.sum(axis=1)

    total, count = lax.map(key_block, jnp.arange(padded // block))  # [blocks, B, bk]
    total, count = (jnp.moveaxis(x, 0, 1).reshape(batch, padded)[:, :length] for x in (total, count))
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


@jax.jit
def anchor_tokens(
    influence: Float[Array, "B T"], mask: Bool[Array, "B T"], fraction: float | Float[Array, ""], horizon_lo: int
) -> Bool[Array, "B T"]:
    """T_glob = TopQ(FAI, q) (Li et al. 2025, eq. 16) of each response: its ceil(q * n) tokens of highest
    FAI among the n whose horizon holds a later response token (t + H_lo within the response: FAI is
    defined), ties to the earlier token. influence [B, T] (FAI of each response token), mask [B, T]
    (a prefix of each row), fraction q in (0, 1]."""
    _validation.check_bt(influence=influence, mask=mask)
    mask = mask.astype(bool)
    later = jnp.cumsum(mask[:, ::-1], axis=1)[:, ::-1] - 1  # valid tokens after each one
    defined = mask & (later >= horizon_lo)
    order = jnp.argsort(-jnp.where(defined, influence, -jnp.inf), axis=1, stable=True)
    rank = jnp.argsort(order, axis=1)
    # Float rounding of q * n (0.7 * 10 = 7.0000001) must not add a token: within 1e-3 above a whole number is it.
    count = jnp.ceil(fraction * defined.sum(axis=1) - 1e-3)
    return defined & (rank < count[:, None])


def attention_anchor_advantages(
    rewards: ArrayLike,
    mask: Bool[Array, "B T"],
    influence: Float[Array, "B T"],
    group: int,
    *,
    normalize_std: bool = True,
    fraction: float = 0.4,
    horizon_lo: int = 10,
    amplification: float = 1.5,
) -> Float[Array, "B T"]:
    """Global-anchor credit (Li et al. 2025, section 5.2 (2), eqs. 13 and 17): GRPO's group-relative advantage
    (`grpo_advantages`, their eq. 6) times gamma_t = 1 + (gamma_amp - 1) 1{t in T_glob}, T_glob =
    `anchor_tokens(influence, mask, fraction, horizon_lo)` of the scoring pass's FAI (Rollout.influence)."""
    advantages = grpo_advantages(jnp.asarray(rewards), group, mask, normalize_std=normalize_std)
    anchors = anchor_tokens(influence, mask, fraction, horizon_lo)
    return advantages * (1.0 + (amplification - 1.0) * anchors)
