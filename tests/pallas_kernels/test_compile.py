"""Compile-level guarantees: no [L, L] intermediate, O(L * block) memory, TPU and GPU lowering.

The TPU tests compile ahead of time with libtpu's real Mosaic compiler for the chips the paper's
runs would use, at Qwen3-4B final-layer shapes, on this CPU machine (recipe in DESIGN.md). They
need libtpu (the `tpu` extra); CI installs it and sets COMPPO_REQUIRE_LIBTPU=1 so a missing
libtpu fails instead of skipping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TPU_TOPOLOGIES, hlo_shapes, jaxpr_shapes, square, tpu_devices

from comppo_jax.models import preset_model_config
from pallas_kernels import attention_with_concentration
from pallas_kernels.tpu import LANES

LONG = 8192


def kernel_inputs(length, *, batch=1, num_heads=4, num_kv_heads=1, head_dim=16, dtype=jnp.float32):
    return (
        jax.ShapeDtypeStruct((batch, length, num_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, length, num_kv_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, length, num_kv_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, length), jnp.bool_),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )


def test_detector_finds_the_reference_backends_l_by_l_probabilities():
    """The check below can fail: the materialized oracle does build [L, L] arrays."""
    f = functools.partial(attention_with_concentration, backend="reference")
    assert square(jaxpr_shapes(jax.make_jaxpr(f)(*kernel_inputs(LONG)).jaxpr), LONG)


@pytest.mark.parametrize("backend", ["interpret", "gpu"])
def test_no_l_by_l_intermediate_and_linear_memory_at_8192(backend):
    interpret = dict(backend="interpret") if backend == "interpret" else {}
    if backend == "gpu":
        from pallas_kernels.gpu import attention_with_concentration_gpu

        f = functools.partial(attention_with_concentration_gpu, interpret=True)
    else:
        f = functools.partial(attention_with_concentration, **interpret)
    inputs = kernel_inputs(LONG)
    assert square(jaxpr_shapes(jax.make_jaxpr(f)(*inputs).jaxpr), LONG) == []
    compiled = jax.jit(f).lower(*inputs).compile()
    assert square(hlo_shapes(compiled.as_text()), LONG) == []

    half = jax.jit(f).lower(*kernel_inputs(LONG // 2)).compile()
    temp, temp_half = compiled.memory_analysis().temp_size_in_bytes, half.memory_analysis().temp_size_in_bytes
    dense_probabilities = LONG * LONG * 4
    # The TPU kernel's per-query segment id and window start, lane-replicated int32 tiles (as splash's
    # query segment ids): linear in L, 1 KiB per token.
    query_tiles = 2 * LONG * LANES * 4 if backend == "interpret" else 0
    assert temp < dense_probabilities / 16 + query_tiles, f"temp {temp} bytes"
    assert temp <= 2.5 * temp_half, f"memory grows faster than L: {temp_half} -> {temp} bytes"


# --- TPU ahead-of-time compiles (libtpu) -------------------------------------------------------


def tpu_mesh(chip):
    # One chip: a Mosaic kernel is not auto-partitioned (sharding is the caller's shard_map).
    return jax.sharding.Mesh(np.array(tpu_devices(chip)[:1]), ("x",))


def qwen3_4b_final_layer(length):
    config = preset_model_config("qwen3_4b")
    return kernel_inputs(
        length,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=jnp.bfloat16,
    )


@functools.cache
def compiled_final_layer(chip, statistics):
    """The kernel AOT-compiled for `chip` at Qwen3-4B final-layer shapes and 16K tokens; cached, as
    two tests below compile the same program for v4 and v5e (a compile takes seconds)."""
    mesh = tpu_mesh(chip)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    f = functools.partial(attention_with_concentration, backend="tpu", statistics=statistics)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = (
            jax.jit(f, in_shardings=replicated, out_shardings=replicated).trace(*qwen3_4b_final_layer(16384)).lower()
        )
        return lowered.compile()


@pytest.mark.parametrize("chip", sorted(TPU_TOPOLOGIES))
def test_tpu_kernel_compiles_at_qwen3_4b_final_layer_shapes(chip):
    """At the paper's 16K context: the kernel's blocks do not depend on the length, only its grid does
    (4096 compiles in test_tpu_kernel_compiles_for_fp32_inputs)."""
    compiled = compiled_final_layer(chip, ())
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.memory_analysis() is not None


def test_tpu_kernel_compiles_bf16_under_a_global_highest_matmul_precision():
    """jax_default_matmul_precision=highest (set for exact fp32 elsewhere) must not reach the
    kernel's bf16 dots, which Mosaic cannot compile at that precision. Qwen3-4B's GQA group of 4 and
    head dim, with fewer heads and tokens: the dots and their precision are the same code at any head
    count and length (this compile takes half as long)."""
    mesh = tpu_mesh("v5e")
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    f = functools.partial(attention_with_concentration, backend="tpu")
    config = preset_model_config("qwen3_4b")
    group = config.num_heads // config.num_kv_heads
    inputs = kernel_inputs(1024, num_heads=group, num_kv_heads=1, head_dim=config.head_dim, dtype=jnp.bfloat16)
    with jax.default_matmul_precision("highest"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(f, in_shardings=replicated, out_shardings=replicated).trace(*inputs).lower().compile()
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("chip", ["v4", "v5e"])
def test_tpu_kernel_with_every_statistic_compiles_within_the_memory_of_herfindahl_alone(chip):
    """Qwen3-4B final layer at 16K: the extra statistics add only per-token outputs and VMEM sums."""
    from pallas_kernels import STATISTICS

    memory = {}
    for statistics in ((), STATISTICS):
        analysis = compiled_final_layer(chip, statistics).memory_analysis()
        memory[statistics] = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    assert memory[STATISTICS] <= 1.1 * memory[()], memory


def test_tpu_kernel_compiles_for_fp32_inputs():
    """fp32 doubles the blocks; the default block sizes must still fit the scoped VMEM (v4: 16 MiB)."""
    mesh = tpu_mesh("v4")
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    inputs = [
        jax.ShapeDtypeStruct(x.shape, jnp.float32 if x.dtype == jnp.bfloat16 else x.dtype)
        for x in qwen3_4b_final_layer(4096)
    ]
    f = functools.partial(attention_with_concentration, backend="tpu")
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        jax.jit(f, in_shardings=replicated, out_shardings=replicated).trace(*inputs).lower().compile()


def test_gpu_kernels_lower_for_cuda():
    # An abstract H100 tells the Triton lowering the compute capability (jax >= 0.11 needs one
    # when no GPU is attached).
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    # Auto named: jax 0.11's AbstractMesh defaults to Explicit axes.
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=h100)
    f = functools.partial(attention_with_concentration, backend="gpu")
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(*qwen3_4b_final_layer(4096)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # attention + LSE, then the concentration
    from pallas_kernels import STATISTICS

    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(functools.partial(f, statistics=STATISTICS)).trace(*qwen3_4b_final_layer(4096))
        assert lowered.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 2
