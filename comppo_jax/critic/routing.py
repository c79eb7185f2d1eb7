"""Native-attention routing for TAC: the top-K window keys of each query, computed blockwise.

The critic pools history over the positions the policy itself attends to (paper eq. globalpool,
"prior-guided causal top-K pooling"). `a_ti` is the final layer's attention probability of the
query at position t on key i, averaged over all query heads, restricted to the window
I_t = {i in [window_start, t] : key i is a real token} and renormalized there: the same object
whose Herfindahl index is the concentration (paper eq. herfindahl).

`window_topk` streams over key blocks with a running top-K per query block, recomputing the
probabilities exactly from the final layer's per-head log-sum-exp (which the concentration
kernel returns), so memory is O(L * K) plus one [Hq, block_q, block_k] tile: no [L, L] array.
It is a detached computation (the positions and weights are behaviour-policy statistics).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import cut_blocks, query_window_start, round_up


class Routing(NamedTuple):
    """The top-K window keys of each query position, best first."""

    indices: jax.Array  # [B, L, K] int32 key positions (0 where not valid)
    weights: jax.Array  # [B, L, K] float32 a_ti renormalized over the whole window I_t (0 where not valid)
    valid: jax.Array  # [B, L, K] bool: slot holds a key of I_t (False past n_t)


def _check(q, k, lse, attention_mask, window_start):
    if q.ndim != 4 or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be [B, L, Hq, D] and k [B, L, Hkv, D], got q {q.shape} and k {k.shape}")
    batch, length, num_heads, _ = q.shape
    if num_heads % k.shape[2]:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of k heads ({k.shape[2]})")
    if lse.shape != (batch, num_heads, length):
        raise ValueError(f"lse must be [B, Hq, L] = {(batch, num_heads, length)}, got {lse.shape}")
    if attention_mask.shape != (batch, length):
        raise ValueError(f"attention_mask must be [B, L] = {(batch, length)}, got {attention_mask.shape}")
    if window_start.shape not in ((batch,), (batch, length)):
        raise ValueError(
            f"window_start must be [B] = ({batch},) or [B, L] = {(batch, length)}, got {window_start.shape}"
        )


KEY_BLOCKS_SCOPE = "window_key_blocks"
BLOCK_Q, BLOCK_K = 128, 512


def row_blocks(length: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """(block_q, block_k, padded length) of `window_topk` on rows of `length` tokens: the blocks cut
    to the row (`cut_blocks`), the row padded to their lcm."""
    block_q, block_k = cut_blocks(length, block_q, block_k, 8)
    return block_q, block_k, round_up(length, math.lcm(block_q, block_k))


def mean_key_blocks(length: int, window_start: int, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> float:
    """Key blocks `window_topk` visits per query block, averaged over the query blocks of a row of
    `length` tokens whose window starts at `window_start` (its loop bound is data-dependent)."""
    block_q, block_k, padded = row_blocks(length, block_q, block_k)
    first = min(window_start // block_k, padded // block_k)
    visits = [max(0, (q * block_q + block_q - 1) // block_k + 1 - first) for q in range(padded // block_q)]
    return sum(visits) / len(visits)


@functools.partial(jax.jit, static_argnames=("top_k", "block_q", "block_k", "sm_scale"))
def window_topk(q, k, lse, attention_mask, window_start, *, top_k=64, block_q=BLOCK_Q, block_k=BLOCK_K, sm_scale=None):
    """Top-K keys of I_t by native attention a_ti, with a_ti renormalized over all of I_t.

    q [B, L, Hq, D], k [B, L, Hkv, D] (the final layer's, after norm and RoPE); lse [B, Hq, L]
    per-head log-sum-exp of the scaled causal logits; attention_mask [B, L] bool;
    window_start [B] int, or per query [B, L] (packed rows: at or after the query's sequence start,
    so I_t holds its own sequence's keys). Where n_t < K the trailing slots are not valid.
    """
    _check(q, k, lse, attention_mask, window_start)
    batch, length, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    block_q, block_k, padded = row_blocks(length, block_q, block_k)
    pad = padded - length
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, pad)))
    key_mask = jnp.pad(attention_mask.astype(bool), ((0, 0), (0, pad)))
    # Per query; queries past L take the row's last start, so they never lower a block's first key.
    window_start = jnp.pad(query_window_start(window_start, length), ((0, 0), (0, pad)), mode="edge")

    def one_query_block(row, q_block):
        q_row, k_row, lse_row, mask_row, start = row
        first_query = q_block * block_q
        q_tile = lax.dynamic_slice_in_dim(q_row, first_query, block_q, 0)  # [bq, Hq, D]
        q_tile = q_tile.reshape(block_q, -1, group, head_dim)  # GQA groups: [bq, Hkv, g, D]
        lse_tile = lax.dynamic_slice_in_dim(lse_row, first_query, block_q, 1).reshape(-1, group, block_q)
        q_pos = first_query + jnp.arange(block_q)
        start_tile = lax.dynamic_slice_in_dim(start, first_query, block_q, 0)[:, None]  # [bq, 1]

        def merge(kv_block, carry):
            best, best_index, mass = carry
            first_key = kv_block * block_k
            k_tile = lax.dynamic_slice_in_dim(k_row, first_key, block_k, 0)  # [bk, Hkv, D]
            logits = jnp.einsum("qhgd,khd->hgqk", q_tile, k_tile, preferred_element_type=jnp.float32) * scale
            head_mean = jnp.exp(logits - lse_tile[..., None]).mean(axis=(0, 1))  # [bq, bk]
            k_pos = first_key + jnp.arange(block_k)
            in_window = (
                (k_pos[None] <= q_pos[:, None])
                & (k_pos[None] >= start_tile)
                & lax.dynamic_slice_in_dim(mask_row, first_key, block_k, 0)[None]
            )
            head_mean = jnp.where(in_window, head_mean, 0.0)
            # Non-window keys score -1, below any probability, so they only fill slots past n_t.
            candidates = jnp.concatenate([best, jnp.where(in_window, head_mean, -1.0)], axis=1)
            candidate_index = jnp.concatenate([best_index, jnp.broadcast_to(k_pos, (block_q, block_k))], axis=1)
            best, order = lax.top_k(candidates, top_k)
            return best, jnp.take_along_axis(candidate_index, order, axis=1), mass + head_mean.sum(axis=1)

        init = (jnp.full((block_q, top_k), -1.0), jnp.zeros((block_q, top_k), jnp.int32), jnp.zeros((block_q,)))
        # Only key blocks that meet [window_start, last query of the block] can contribute.
        first_block = jnp.clip(lax.div(jnp.min(start_tile), block_k), 0, padded // block_k)
        last_block = lax.div(first_query + block_q - 1, block_k) + 1
        with jax.named_scope(KEY_BLOCKS_SCOPE):  # the planner's cost model counts this loop by this name
            best, best_index, mass = lax.fori_loop(first_block, jnp.maximum(first_block, last_block), merge, init)
        valid = (best >= 0.0) & (mass[:, None] > 0.0)
        weights = jnp.where(valid, best / jnp.where(mass > 0, mass, 1.0)[:, None], 0.0)
        return jnp.where(valid, best_index, 0), weights, valid

    def one_row(row):
        blocks = lax.map(functools.partial(one_query_block, row), jnp.arange(padded // block_q))
        return jax.tree.map(lambda x: x.reshape(padded, top_k)[:length], blocks)

    indices, weights, valid = jax.vmap(one_row)((q, k, lse, key_mask, window_start))
    return Routing(indices, weights, valid)
