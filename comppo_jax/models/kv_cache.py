"""Incremental decoding with a KV cache: prefill a left-padded prompt, then one token per step.

The cache holds every layer's post-RoPE keys and values in slots [0, max_length): the prompt
occupies [0, P) (left padding, so every row's last prompt token is at slot P - 1) and decode
step s writes slot P + s. RoPE positions count real tokens, exactly as `forward` does, so the
logits at a slot equal `forward`'s on the same right-aligned sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from comppo_jax.models.config import ModelConfig
from comppo_jax.models.transformer import _decoder_layer, embed_tokens, lm_logits, rms_norm, rope_inv_freq, scan_layers
from pallas_kernels.common import causal_attention


class KVCache(NamedTuple):
    k: Float[Array, "N B S Hkv hd"]  # post-RoPE keys, config.dtype
    v: Float[Array, "N B S Hkv hd"]
    valid: Bool[Array, "B S"]  # slot holds a real token
    next_position: Int[Array, " B"]  # int32: RoPE position of the next token


def _final_logits(params: dict, config: ModelConfig, x: Float[Array, "B L D"]) -> Float[Array, "B V"]:
    return lm_logits(params, config, rms_norm(x, params["final_norm"], config.rms_norm_eps))[:, -1]


def prefill(
    params: dict, config: ModelConfig, tokens: Int[Array, "B P"], attention_mask: Bool[Array, "B P"], max_length: int
) -> tuple[Float[Array, "B V"], KVCache]:
    """Runs the left-padded prompt tokens [B, P] and returns (logits of its last slot [B, V], cache)."""
    batch, length = tokens.shape
    if max_length < length:
        raise ValueError(f"max_length={max_length} is shorter than the prompt ({length} slots)")
    dtype = jnp.dtype(config.dtype)
    inv_freq = jnp.asarray(rope_inv_freq(config))
    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)

    def step(x: Array, scanned: tuple[dict[str, Array]]) -> tuple[Array, tuple[Array, Array]]:
        attention = lambda q, k, v: (causal_attention(q, k, v, attention_mask), (k, v))
        return _decoder_layer(scanned[0], x, positions, config, inv_freq, attention)

    x, (keys, values) = scan_layers(step, embed_tokens(params, tokens, dtype), params["layers"])
    pad = ((0, 0), (0, 0), (0, max_length - length), (0, 0), (0, 0))
    cache = KVCache(
        jnp.pad(keys, pad),
        jnp.pad(values, pad),
        jnp.pad(attention_mask, ((0, 0), (0, max_length - length))),
        attention_mask.sum(axis=1).astype(jnp.int32),
    )
    return _final_logits(params, config, x), cache


def decode_step(
    params: dict, config: ModelConfig, token: Int[Array, " B"], cache: KVCache, slot: int | Int[Array, ""]
) -> tuple[Float[Array, "B V"], KVCache]:
    """Feeds one token per row [B] at cache slot `slot` (a traced int); returns (logits [B, V], cache)."""
    dtype = jnp.dtype(config.dtype)
    inv_freq = jnp.asarray(rope_inv_freq(config))
    valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, jnp.ones((token.shape[0], 1), bool), slot, axis=1)
    visible = valid & (jnp.arange(valid.shape[1]) <= slot)[None]  # [B, S]
    positions = cache.next_position[:, None]

    def step(
        carry: tuple[Array, Array, Array], scanned: tuple[dict[str, Array], Array]
    ) -> tuple[tuple[Array, Array, Array], None]:
        x, keys, values = carry
        layer, index = scanned

        def attention(q: Array, k: Array, v: Array) -> tuple[Array, tuple[Array, Array]]:
            # Write only the new slot, in place in the carried cache, then read the layer back.
            start = (index, 0, slot, 0, 0)
            new_keys = jax.lax.dynamic_update_slice(keys, k[None].astype(keys.dtype), start)
            new_values = jax.lax.dynamic_update_slice(values, v[None].astype(values.dtype), start)
            layer_k = jax.lax.dynamic_index_in_dim(new_keys, index, 0, keepdims=False)
            layer_v = jax.lax.dynamic_index_in_dim(new_values, index, 0, keepdims=False)
            out = jax.nn.dot_product_attention(q, layer_k, layer_v, mask=visible[:, None, None, :])
            return out, (new_keys, new_values)

        x, (keys, values) = _decoder_layer(layer, x, positions, config, inv_freq, attention)
        return (x, keys, values), None

    x = embed_tokens(params, token, dtype)[:, None]
    (x, keys, values), _ = scan_layers(step, (x, cache.k, cache.v), params["layers"], jnp.arange(config.num_layers))
    return _final_logits(params, config, x), KVCache(keys, values, valid, cache.next_position + 1)
