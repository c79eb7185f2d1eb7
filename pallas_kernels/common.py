"""Input checks shared by every attention-with-concentration backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_attention_inputs(q, k, v, attention_mask, window_start=None):
    """Validates shapes/dtypes (window_start=None: attention without a concentration window);
    returns (batch, length, num_heads, head_dim, num_kv_heads)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, L, Hq, D], got shape {q.shape}")
    batch, length, num_heads, head_dim = q.shape
    for name, tensor in (("k", k), ("v", v)):
        if tensor.ndim != 4 or tensor.shape[:2] != (batch, length) or tensor.shape[3] != head_dim:
            raise ValueError(f"{name} must be [B, L, Hkv, D] = [{batch}, {length}, Hkv, {head_dim}], got shape {tensor.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    num_kv_heads = k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of k/v heads ({num_kv_heads})")
    if attention_mask.shape != (batch, length) or attention_mask.dtype != jnp.bool_:
        raise ValueError(
            f"attention_mask must be bool [B, L] = [{batch}, {length}], got {attention_mask.dtype} {attention_mask.shape}"
        )
    if window_start is not None and (window_start.shape != (batch,) or not jnp.issubdtype(window_start.dtype, jnp.integer)):
        raise ValueError(f"window_start must be int [B] = [{batch}], got {window_start.dtype} {window_start.shape}")
    return batch, length, num_heads, head_dim, num_kv_heads


# A finite "minus infinity" for masked logits: exp() of it is 0 and max() of it never yields NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def window_sizes(attention_mask, window_start):
    """n [B, L] int32: real keys in [window_start, p] for each query p (0 when p < window_start).

    Computed from prefix counts of the mask, so no kernel needs to count keys.
    """
    counts = jnp.cumsum(attention_mask.astype(jnp.int32), axis=1)  # real keys in [0, p]
    before = jnp.take_along_axis(counts, jnp.clip(window_start[:, None] - 1, 0, attention_mask.shape[1] - 1), axis=1)
    before = jnp.where(window_start[:, None] > 0, before, 0)  # real keys in [0, window_start)
    positions = jnp.arange(attention_mask.shape[1])[None]
    return jnp.where(positions >= window_start[:, None], counts - before, 0).astype(jnp.int32)


def causal_attention(q, k, v, attention_mask, *, sm_scale=None):
    """Plain causal GQA attention, `jax.nn.dot_product_attention` (XLA; cuDNN where it applies).

    The layers without concentration use it, and it supplies the gradient of the kernels' output.
    """
    length = q.shape[1]
    causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
    mask = causal[None, None] & attention_mask[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=sm_scale)
