"""The sampler's 8-bit weights: a scale per output channel, read by the transformer as the
dequantized weights, split over the decode mesh as their channels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comppo_jax import sharding
from comppo_jax.models import ModelConfig, forward, init_params
from comppo_jax.models.quantize import OUTPUT_AXIS, SCALE, is_quantized, sampler_weights
from comppo_jax.models.transformer import fuse_projections

CONFIG = ModelConfig(
    architecture="qwen3",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
    eos_token_ids=(),
    pad_token_id=0,
)
TOKENS = jnp.asarray([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]], jnp.int32)


def dequantized(quantized: dict) -> dict:
    """The float weights an int8 params dict stands for: each matrix times its scales."""

    def walk(tree: dict) -> dict:
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = walk(value)
            elif name in OUTPUT_AXIS:
                scale = jnp.expand_dims(
                    tree[name + SCALE],
                    [a for a in range(value.ndim) if a not in (0, OUTPUT_AXIS[name])][-1]
                    if value.ndim == 3
                    else 1 - OUTPUT_AXIS[name],
                )
                out[name] = value.astype(jnp.float32) * scale
            elif not name.endswith(SCALE):
                out[name] = value
        return out

    return walk(quantized)


@pytest.mark.parametrize("tied", [False, True])
def test_int8_weights_run_as_their_dequantized_floats(tied):
    """Every matrix's scales are applied on its output channels: the embedding rows, a tied or
    untied head's vocabulary, each projection's outputs, fused on CPU (`fuse_projections`)."""
    config = CONFIG.replace(tie_word_embeddings=tied)
    params = init_params(config, jax.random.PRNGKey(0), init_std=0.3)
    quantized = sampler_weights(params, "int8", config.dtype)
    assert is_quantized(quantized) and not is_quantized(params)
    for name, axis in OUTPUT_AXIS.items():
        weights = quantized.get(name, quantized["layers"].get(name))
        if weights is None:  # a tied head
            continue
        scales = quantized.get(name + SCALE, quantized["layers"].get(name + SCALE))
        channels = (weights.shape[0], weights.shape[2]) if weights.ndim == 3 else (weights.shape[axis],)
        assert weights.dtype == jnp.int8 and scales.shape == channels, name
    mask = TOKENS != 0
    out = forward(quantized, config, TOKENS, mask)
    np.testing.assert_allclose(
        out.logits, forward(dequantized(quantized), config, TOKENS, mask).logits, rtol=1e-5, atol=1e-5
    )
    # ... which are the float weights to within half a step of each channel's scale.
    for name in ("q_proj", "down_proj"):
        error = np.abs(np.asarray(dequantized(quantized)["layers"][name] - params["layers"][name]))
        step = np.asarray(quantized["layers"][name + SCALE])[:, None, :]
        assert (error <= step / 2 + 1e-7).all()


def test_fused_projections_join_their_scales():
    quantized = sampler_weights(init_params(CONFIG, jax.random.PRNGKey(1)), "int8", CONFIG.dtype)
    fused = fuse_projections(quantized["layers"])
    assert fused["qkv_proj"].shape[-1] == fused["qkv_proj" + SCALE].shape[-1]
    assert fused["gate_up_proj"].shape[-1] == fused["gate_up_proj" + SCALE].shape[-1]
    assert not {"q_proj", "q_proj" + SCALE, "up_proj" + SCALE} & set(fused)


def test_other_dtypes_are_casts():
    params = init_params(CONFIG, jax.random.PRNGKey(0))
    for weight_dtype, dtype in (("auto", CONFIG.dtype), ("bfloat16", "bfloat16"), ("float32", "float32")):
        cast = sampler_weights(params, weight_dtype, CONFIG.dtype)
        assert jax.tree.structure(cast) == jax.tree.structure(params)
        assert {leaf.dtype for leaf in jax.tree.leaves(cast)} == {jnp.dtype(dtype)}
    with pytest.raises(ValueError, match="int4"):
        sampler_weights(params, "int4", CONFIG.dtype)


def test_scales_split_as_their_weights_output_channels():
    mesh = jax.sharding.AbstractMesh((1, 1, 2), sharding.AXES)
    shapes = jax.eval_shape(lambda: sampler_weights(init_params(CONFIG, jax.random.PRNGKey(0)), "int8", CONFIG.dtype))
    specs = jax.tree_util.tree_map_with_path(lambda path, x: sharding.leaf_spec(mesh, path, x.shape), shapes)
    assert specs["layers"]["q_proj" + SCALE] == jax.sharding.PartitionSpec(None, "tensor")
    assert specs["embed" + SCALE] == specs["lm_head" + SCALE] == jax.sharding.PartitionSpec("tensor")
