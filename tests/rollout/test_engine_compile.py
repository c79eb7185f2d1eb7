"""A decode step of the rollout engine compiles for the accelerators: the TPU ragged paged attention
kernel (and, for 8-bit pages, ours) ahead of time with libtpu (v5e, v5p), the GPU paged attention
kernel lowered for CUDA.

Qwen3-4B's layer dims (two layers, which is enough to compile the scanned layer), one shard of
16 slots, a 16K-token context in 64-token pages.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tpu_devices

from comppo_jax import sharding
from comppo_jax.models import param_shapes, preset_model_config
from comppo_jax.models.quantize import sampler_weights
from comppo_jax.rollout import engine, generate

SLOTS, CONTEXT, PAGE = 16, 16384, 64


def decode_step_inputs(backend, kv_dtype="auto", weight_dtype="auto"):
    config = dataclasses.replace(preset_model_config("qwen3_4b"), num_layers=2)
    dtype = jnp.dtype(config.dtype)
    params = jax.eval_shape(
        lambda: sampler_weights(
            jax.tree.map(
                lambda shape: jnp.zeros(shape, dtype), param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
            ),
            weight_dtype,
            config.dtype,
        )
    )
    table_width = CONTEXT // PAGE
    pages_dtype = engine.paged_cache.kv_dtype(kv_dtype, config.dtype)
    pool = jax.eval_shape(
        lambda: engine.paged_cache.empty_pool(
            config.num_layers, 1 + SLOTS * table_width, PAGE, config.num_kv_heads, config.head_dim, pages_dtype, backend
        )
    )
    pool = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1,) + a.shape, a.dtype), pool)  # one shard
    rows = lambda *shape: jax.ShapeDtypeStruct((1, SLOTS) + shape, jnp.int32)

    def step(params, tokens, pool, tables, length, write_page):  # the stacked (scanned) layers, as on an accelerator
        return engine.decode_layers(
            params,
            engine.layer_weights(params, unrolled=False),
            config,
            tokens,
            pool,
            tables,
            length,
            write_page,
            backend,
        )

    return step, (params, rows(), pool, rows(table_width), rows(), rows())


def compiled_tpu_step(chip):
    step, inputs = decode_step_inputs("tpu")
    mesh = jax.sharding.Mesh(
        np.array(tpu_devices(chip)[:1]).reshape(1, 1, 1), sharding.AXES
    )  # one chip, the run's axes
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = (
            jax.jit(step, in_shardings=replicated, out_shardings=replicated, donate_argnums=2)
            .trace(*inputs)
            .lower()
            .compile()
        )
    return compiled, inputs[2]


def test_tpu_decode_step_compiles_at_qwen3_4b_dims_with_a_16k_context():
    """On v5e; the slow tier compiles the engine for v5p (8-bit pages, and the decode layouts)."""
    compiled, pool = compiled_tpu_step("v5e")
    assert "ragged_paged_attention" in compiled.as_text()
    pool_bytes = sum(np.prod(a.shape) * a.dtype.itemsize for a in pool.arrays)
    # The pool is updated in place: the step needs no second copy of it.
    assert compiled.memory_analysis().temp_size_in_bytes < pool_bytes / 4


@pytest.mark.slow
def test_8bit_rollouts_decode_their_pages_in_place():
    """The engine's whole program with int8 pages, scale rows and weights (Qwen3-4B's dims, two
    layers, two kv heads, one v5p chip): our kernel reads the pool as the decode loop's writes left
    it. Scattering single tokens' bytes or scales, or gathering every written scale row at once,
    makes XLA re-tile the whole array (every layer's) for the write and copy it back for the
    kernel, at every layer of every step (`paged_cache.PACKED_TOKENS`, `paged_cache.write_tokens`)."""
    # Two kv heads: a chip's share of Qwen3-4B's 8 in a group of 4 (a decode layout the plan picks).
    config = dataclasses.replace(preset_model_config("qwen3_4b"), num_layers=2, num_kv_heads=2)
    shapes = jax.tree.map(
        lambda shape: jnp.zeros(shape, config.dtype), param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )
    params = jax.eval_shape(lambda: sampler_weights(shapes, "int8", config.dtype))
    mesh = jax.sharding.Mesh(np.array(tpu_devices("v5p")[:1]).reshape(1, 1, 1), sharding.AXES)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    prompts = jax.ShapeDtypeStruct((4, 64), jnp.int32)
    sample = lambda params, tokens, mask, key: generate(
        params, config, tokens, mask, key, max_new_tokens=512, num_samples=4, eos_token_ids=(0,), kv_dtype="int8"
    )
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        text = (
            jax.jit(sample, in_shardings=replicated, out_shardings=replicated)
            .trace(params, prompts, prompts.update(dtype=jnp.bool_), jax.ShapeDtypeStruct((2,), jnp.uint32))
            .lower()
            .compile()
            .as_text()
        )
    assert "quantized_paged_attention" in text and "ragged_paged_attention" not in text
    pool_like = re.compile(r"= (s8\[1,2,\d+,64,128\]|f32\[1,\d+,256\])\S* copy(-start)?\(")
    assert [line for line in text.splitlines() if pool_like.search(line)] == []


def test_gpu_decode_step_lowers_for_cuda():
    step, inputs = decode_step_inputs("gpu")
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    # Auto named: jax 0.11's AbstractMesh defaults to Explicit axes, which the decode step's shard_map refuses.
    mesh = jax.sharding.AbstractMesh(
        (1, 1, 1), sharding.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, abstract_device=h100
    )
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(step).trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "paged_attention" in text
