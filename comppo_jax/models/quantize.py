"""8-bit numbers for the sampler: weights with a scale per output channel, KV-cache rows with a
scale per (token, kv head).

Decoding is bound by the bytes it reads per token step: every weight once, and each live row's
keys and values. Symmetric 8-bit storage halves both against bfloat16:

    s   = max |x| / Q          (over the input axis of a weight's output channel, or over the
                                head dim of one token's key or value in one kv head)
    x_q = round(x / s)         (int8, Q = 127)   or   cast(x / s)   (float8_e4m3fn, Q = 448)
    x  ~= x_q * s

The sampler's weights are quantized once per step, when the actor moves into the decode layout
(comppo_jax.train.decode_layout); the learner keeps its own precision. A quantized matrix W sits in
the params dict as int8 beside its float32 scales `W + SCALE` ([N, out] for a layer's [N, in, out],
[V] for the embedding table and the untied head), so the params stay a plain dict that jit,
sharding (comppo_jax.sharding.PARAM_RULES) and the transformer (`transformer._project`) read
directly: y = (x @ W_q) * s, the scale applied to the float32 accumulator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8")
SCALE = "_scale"  # a quantized weight W's scales are params[... W + SCALE]
# The largest magnitude each 8-bit format stores: int8 keeps [-127, 127] (symmetric), e4m3 448.
LARGEST = {"int8": 127.0, "float8_e4m3fn": 448.0}
# The matrices a decode step reads, by the axis of their output channels (the vocabulary for the
# embedding table, which a tied head reads transposed); the norms stay in the compute dtype.
OUTPUT_AXIS = {
    "embed": 0,
    "lm_head": 1,
    "q_proj": 2,
    "k_proj": 2,
    "v_proj": 2,
    "o_proj": 2,
    "gate_proj": 2,
    "up_proj": 2,
    "down_proj": 2,
}


def quantize(x: Float[Array, ...], dtype: str, axis: int | tuple[int, ...]) -> tuple[Shaped[Array, ...], Array]:
    """Symmetric 8-bit x ~= x_q * s, with s = max |x| / Q over `axis` (module docstring).
    Returns (x_q in `dtype`, s float32 with `axis` dropped). An all-zero slice gets s = 1."""
    x32 = x.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x32), axis=axis, keepdims=True)
    scale = jnp.where(peak > 0, peak / LARGEST[dtype], 1.0)
    scaled = x32 / scale
    if dtype == "int8":
        stored = jnp.clip(jnp.round(scaled), -LARGEST[dtype], LARGEST[dtype]).astype(jnp.int8)
    else:
        stored = scaled.astype(jnp.dtype(dtype))
    return stored, jnp.squeeze(scale, axis)


def sampler_weights(params: dict, weight_dtype: str, compute_dtype: str) -> dict:
    """The sampler's copy of `params`: cast to `weight_dtype` ("auto": the compute dtype), or at
    "int8" every matrix of `OUTPUT_AXIS` quantized per output channel beside its `SCALE` and the
    rest in the compute dtype."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight_dtype!r} is not one of {WEIGHT_DTYPES}")
    if weight_dtype != "int8":
        dtype = compute_dtype if weight_dtype == "auto" else weight_dtype
        return jax.tree.map(lambda p: p.astype(dtype), params)

    def convert(tree: dict) -> dict:
        out: dict = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = convert(value)
            elif name in OUTPUT_AXIS:
                axis = OUTPUT_AXIS[name]
                reduced = tuple(a for a in range(1, value.ndim) if a != axis) if value.ndim == 3 else 1 - axis
                out[name], out[name + SCALE] = quantize(value, "int8", reduced)
            else:
                out[name] = value.astype(compute_dtype)
        return out

    return convert(params)


def is_quantized(params: dict) -> bool:
    """Whether `params` hold 8-bit matrices (`sampler_weights(..., "int8")`)."""
    return "embed" + SCALE in params
