"""NumPy float64 oracles for the attention-anchor credit (Li et al. 2025, Def. 4.2 and section 5.2 (2)), written
from the paper's definitions on materialized attention, independently of the blockwise code under test."""

from __future__ import annotations

import math

import numpy as np


def head_mean_attention(q, k, mask) -> np.ndarray:
    """[B, Lq, Lk]: each query's causal softmax over the real keys, per head, averaged over the heads."""
    q, k, mask = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(mask)
    length, heads, dim = q.shape[1:]
    k = np.repeat(k, heads // k.shape[2], axis=2)  # query head h reads kv head h // group
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim)
    allowed = np.tril(np.ones((length, length), bool))[None, None] & mask[:, None, None, :]
    logits = np.where(allowed, logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    probs = np.exp(logits)
    return (probs / probs.sum(-1, keepdims=True)).mean(axis=1)


def fai(attention, response_start, real, b, s, horizon) -> float:
    """FAI_s (Def. 4.2) of the key at position s of row b: the mean attention on it of the response positions t
    (in [response_start[b], real[b])) with H_lo <= t - s <= H_hi; 0 where there is none."""
    queries = [t for t in range(response_start[b], real[b]) if horizon[0] <= t - s <= horizon[1]]
    return attention[b, queries, s].mean() if queries else 0.0


def token_influence(attention, prompt_lengths, response_lengths, horizon, width) -> np.ndarray:
    """[B, width]: FAI of each response token y_t (0-based t), the key at its own position P + t; 0 past it."""
    real = np.asarray(prompt_lengths) + np.asarray(response_lengths)
    return np.asarray(
        [
            [fai(attention, prompt_lengths, real, b, p + t, horizon) if t < n else 0.0 for t in range(width)]
            for b, (p, n) in enumerate(zip(prompt_lengths, response_lengths))
        ]
    )


def anchors(influence, response_lengths, fraction, horizon_lo) -> np.ndarray:
    """T_glob = TopQ(FAI, q) per response: of its n tokens with a response token H_lo or more later, the
    ceil(q n) of highest FAI (ties to the earlier), as a [B, T] bool."""
    out = np.zeros(np.shape(influence), bool)
    for b, n in enumerate(response_lengths):
        defined = max(n - horizon_lo, 0)
        order = sorted(range(defined), key=lambda t: (-influence[b][t], t))
        out[b, order[: math.ceil(round(fraction * defined, 6))]] = True
    return out


def grpo(rewards, group, eps=1e-6) -> np.ndarray:
    """[B]: (R_i - mean) / (std + eps) over each group of `group` consecutive rows (unbiased std; 0 if tied)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    centred = r - r.mean(1, keepdims=True)
    std = r.std(1, ddof=1, keepdims=True)
    tied = (r == r[:, :1]).all(1, keepdims=True)
    return np.where(tied, 0.0, centred / (std + eps)).ravel()


def materialized_influence(params, config, generation, response_lengths, horizon, width) -> np.ndarray:
    """`token_influence` [B, width] of a generation, from the final layer's attention materialized by a forward
    pass of `params` (the model under test's own queries and keys)."""
    from comppo_jax.models import forward

    out = forward(
        params,
        config,
        generation.tokens,
        generation.attention_mask,
        generation.prompt_lengths,
        hidden_layers=(),
        return_final_attention=True,
        compute_logits=False,
    )
    attention = head_mean_attention(out.final_attention.q, out.final_attention.k, generation.attention_mask)
    return token_influence(attention, np.asarray(generation.prompt_lengths), response_lengths, horizon, width)
