"""The 8-bit paged decode attention kernel: interpreted on CPU against the dequantizing oracle, never
reading past a row's length, and AOT-compiled for TPU at Qwen3-4B decode shapes (libtpu)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TPU_TOPOLOGIES, tpu_devices
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import quantized_paged_attention as module
from pallas_kernels.quantized_paged_attention import (
    VMEM_BUDGET_BYTES,
    default_pages_per_block,
    quantized_paged_attention,
    quantized_paged_attention_reference,
    vmem_bytes,
)

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # bf16: the probabilities enter the PV matmul in bf16
# Jitted once for the module: an interpreted call compiles for seconds and runs for milliseconds, and
# unjitted each call compiles again; tests whose inputs share shapes and settings share the compile.
interpreted = functools.partial(
    jax.jit(quantized_paged_attention, static_argnames=("sm_scale", "pages_per_block", "interpret")), interpret=True
)
reference = jax.jit(quantized_paged_attention_reference, static_argnames="sm_scale")  # op by op: ~1 s a shape


def make_cache(
    *,
    lengths,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    page_size=16,
    width=5,
    spare_pages=3,
    kv_dtype=jnp.int8,
    q_dtype=jnp.float32,
    seed=0,
):
    """(q, k_pages, v_pages, scale_rows, lengths, page_indices): every row's table a slice of one
    random permutation of the pool's pages (non-contiguous, out of order), plus unused pages."""
    rng = np.random.default_rng(seed)
    rows = len(lengths)
    num_pages = rows * width + spare_pages
    shape = (num_kv_heads, num_pages, page_size, head_dim)

    def pages():
        if kv_dtype == jnp.int8:
            return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        return jnp.asarray(rng.standard_normal(shape) * 8, kv_dtype)

    largest = 0.02 if kv_dtype == jnp.int8 else 0.3
    scale_rows = rng.uniform(0.1, 1.0, (num_pages, num_kv_heads * 2 * page_size)) * largest
    return (
        jnp.asarray(rng.standard_normal((rows, num_heads, head_dim)), q_dtype),
        pages(),
        pages(),
        jnp.asarray(scale_rows, jnp.float32),
        jnp.asarray(lengths, jnp.int32),
        jnp.asarray(rng.permutation(num_pages)[: rows * width].reshape(rows, width), jnp.int32),
    )


def assert_matches_reference(inputs, attend=interpreted, **kwargs):
    q = inputs[0]
    sm_scale = q.shape[-1] ** -0.5
    out = attend(*inputs, sm_scale=sm_scale, interpret=kwargs.pop("interpret", True), **kwargs)
    expected = reference(*inputs, sm_scale=sm_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    tolerance = TOLERANCE[q.dtype.type]
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=tolerance, rtol=tolerance
    )
    return out


# Lengths per page size and table width 5: 1 token, exactly one page, mid-page, a full table.
LENGTHS = {16: [1, 16, 37, 80], 64: [1, 64, 150, 320]}


# Each value of each setting in some case, each pool dtype with each query dtype: the settings meet
# in different code (dequantizing the pool, the GQA group's rows, pages per block, the head layout).
@pytest.mark.parametrize(
    "kv_dtype, q_dtype, group, page_size, head_dim",
    [
        (jnp.int8, jnp.float32, 1, 16, 128),
        (jnp.int8, jnp.bfloat16, 4, 64, 64),
        (jnp.float8_e4m3fn, jnp.float32, 4, 64, 128),
        (jnp.float8_e4m3fn, jnp.bfloat16, 2, 16, 128),
    ],
)
def test_matches_the_dequantizing_reference(kv_dtype, q_dtype, group, page_size, head_dim):
    """Ragged lengths (1, a page boundary, mid-page, the whole table), permuted tables, GQA, and 2
    pages per block, which does not divide the table width 5."""
    inputs = make_cache(
        lengths=LENGTHS[page_size],
        num_heads=2 * group,
        head_dim=head_dim,
        page_size=page_size,
        kv_dtype=kv_dtype,
        q_dtype=q_dtype,
    )
    assert_matches_reference(inputs, pages_per_block=2)


def test_blocks_of_several_compute_chunks(monkeypatch):
    """Blocks of 2 chunks of 2 pages each, ending mid-chunk and mid-page, over 2 kv heads."""
    monkeypatch.setattr(module, "CHUNK_TOKENS", 32)
    assert module.chunk_pages(4, 16) == 2
    inputs = make_cache(lengths=[1, 40, 71, 112], width=7)
    # Not `interpreted`: its cache would keep this trace, and CHUNK_TOKENS is read when tracing.
    assert_matches_reference(inputs, attend=quantized_paged_attention, pages_per_block=4)


@pytest.mark.parametrize("rows", [3, 4])
def test_double_buffering_is_race_free_on_two_cores(rows):
    """Two simulated TensorCores (each takes half of an even number of rows) with the interpreter's
    race detector over the DMAs and the buffers they fill."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the race detector's state

    inputs = make_cache(lengths=[33, 1, 80, 16][:rows])
    params = pltpu.InterpretParams(num_cores_or_threads=2, detect_races=True, dma_execution_mode="eager")
    assert_matches_reference(inputs, pages_per_block=2, interpret=params)
    assert not interpret_pallas_call.races.races_found


def poisoned(inputs, unread_page):
    """The cache with NaN in every slot past each row's length and in the unused pages (keys and
    values too where their dtype holds NaN), and table entries past the length out of the pool."""
    q, k_pages, v_pages, scale_rows, lengths, tables = inputs
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    tokens = np.arange(tables.shape[1] * page_size)
    filled = np.zeros(num_pages * page_size, bool)  # per (page, slot): some row attends it
    for row_tables, length in zip(np.asarray(tables), np.asarray(lengths)):
        used = tokens[:length]
        filled[row_tables[used // page_size] * page_size + used % page_size] = True
    filled = filled.reshape(num_pages, page_size)

    def poison(pages):
        if not jnp.issubdtype(pages.dtype, jnp.floating):
            return pages
        return jnp.where(filled[:, :, None], pages, jnp.asarray(jnp.nan, pages.dtype))

    row_filled = np.tile(filled[:, None, None, :], (1, num_kv_heads, 2, 1)).reshape(scale_rows.shape)
    read = tokens[None, ::page_size] < np.asarray(lengths)[:, None]  # [S, W]: table entries read
    tables = jnp.where(read, tables, unread_page)
    return (q, poison(k_pages), poison(v_pages), jnp.where(row_filled, scale_rows, jnp.nan), lengths, tables)


# Each pool dtype with the query dtype and heads of a test_matches_the_dequantizing_reference case
# (page size 16, head dim 128), whose compile serves.
POISONED_CASES = [(jnp.int8, jnp.float32, 2), (jnp.float8_e4m3fn, jnp.bfloat16, 4)]


@pytest.mark.parametrize("kv_dtype, q_dtype, num_heads", POISONED_CASES)
def test_never_reads_past_a_rows_length(kv_dtype, q_dtype, num_heads):
    """NaN past every length and in every unused page, table entries past the length pointing out
    of the pool (the interpreter raises on an out-of-bounds DMA): the output is finite and equal."""
    inputs = make_cache(lengths=[1, 16, 37, 70], num_heads=num_heads, kv_dtype=kv_dtype, q_dtype=q_dtype)
    attend = functools.partial(interpreted, sm_scale=128**-0.5, pages_per_block=2)
    clean = attend(*inputs)
    out = attend(*poisoned(inputs, unread_page=inputs[1].shape[1] + 1000))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))


def test_the_poisoned_table_does_fail_when_read():
    """The check above can fail: a length that covers an out-of-pool table entry makes the
    interpreter raise (in its int8 case)."""
    kv_dtype, q_dtype, num_heads = POISONED_CASES[0]
    inputs = make_cache(lengths=[1, 16, 37, 70], num_heads=num_heads, kv_dtype=kv_dtype, q_dtype=q_dtype)
    q, k_pages, v_pages, scale_rows, lengths, tables = poisoned(inputs, unread_page=inputs[1].shape[1] + 1000)
    try:
        with pytest.raises(Exception, match="(?i)out.of.bounds"):
            interpreted(
                q, k_pages, v_pages, scale_rows, lengths.at[0].set(17), tables, sm_scale=128**-0.5, pages_per_block=2
            ).block_until_ready()
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def test_a_row_of_length_zero_gives_zeros():
    """Rows of length 0 first and last on a core's chain of rows, beside rows of real lengths (the
    shapes and settings of the first test_matches_the_dequantizing_reference case, whose compile serves)."""
    inputs = make_cache(lengths=[0, 37, 16, 0], num_heads=2)
    out = interpreted(*inputs, sm_scale=128**-0.5, pages_per_block=2)
    empty = np.asarray(inputs[4]) == 0
    assert (np.asarray(out)[empty] == 0).all()
    expected = reference(*inputs, sm_scale=128**-0.5)
    np.testing.assert_allclose(np.asarray(out)[~empty], np.asarray(expected)[~empty], atol=1e-5, rtol=1e-5)


def test_default_block_fits_the_vmem_budget():
    # Qwen3-4B, 64-token pages: 16 pages (1024 tokens, 2 MiB of keys and values) with all 8 kv heads,
    # the whole 257-page table with 1 kv head (8 chips), and never more than the table.
    assert default_pages_per_block(257, 64, 8, 4, 128, 2) == 16
    assert default_pages_per_block(257, 64, 1, 4, 128, 2) == 128
    assert default_pages_per_block(5, 16, 2, 2, 128, 4) == 5
    for args in ((257, 64, 8, 4, 128, 2), (257, 16, 8, 4, 128, 4), (257, 64, 32, 1, 128, 4)):
        assert vmem_bytes(default_pages_per_block(*args), *args[1:]) <= VMEM_BUDGET_BYTES


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x: x._replace(k_pages=x.k_pages.astype(jnp.bfloat16)), "k_pages"),
        (lambda x: x._replace(scale_rows=x.scale_rows[:, :-1]), "scale_rows"),
        (lambda x: x._replace(q=x.q[:, :3]), "multiple of kv heads"),
        (lambda x: x._replace(lengths=x.lengths.astype(jnp.float32)), "lengths"),
    ],
)
def test_rejects_bad_inputs(change, message):
    from typing import NamedTuple

    class Inputs(NamedTuple):
        q: jax.Array
        k_pages: jax.Array
        v_pages: jax.Array
        scale_rows: jax.Array
        lengths: jax.Array
        page_indices: jax.Array

    inputs = change(Inputs(*make_cache(lengths=[1, 2])))
    with pytest.raises(ValueError, match=message):
        quantized_paged_attention(*inputs, sm_scale=1.0, interpret=True)


# --- TPU ahead-of-time compiles (libtpu) -------------------------------------------------------

# Qwen3-4B decode: 16 rows, 32 q heads over 8 kv heads (or one chip's 4 over 1 of 8 chips), head dim
# 128, a pool of 36 layers x 300 pages of 64 tokens, tables 257 pages wide.
QWEN3_4B = {"all heads": (32, 8), "one of 8 chips": (4, 1)}
ROWS, HEAD_DIM, PAGE_SIZE, POOL_PAGES, WIDTH = 16, 128, 64, 36 * 300, 257


def compile_for_tpu(chip, num_heads, num_kv_heads, kv_dtype):
    mesh = jax.sharding.Mesh(np.array(tpu_devices(chip)[:1]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    pool = (num_kv_heads, POOL_PAGES, PAGE_SIZE, HEAD_DIM)
    inputs = (
        jax.ShapeDtypeStruct((ROWS, num_heads, HEAD_DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct(pool, kv_dtype),
        jax.ShapeDtypeStruct(pool, kv_dtype),
        jax.ShapeDtypeStruct((POOL_PAGES, num_kv_heads * 2 * PAGE_SIZE), jnp.float32),
        jax.ShapeDtypeStruct((ROWS,), jnp.int32),
        jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.int32),
    )
    f = functools.partial(quantized_paged_attention, sm_scale=HEAD_DIM**-0.5)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.jit(f, in_shardings=replicated, out_shardings=replicated).trace(*inputs).lower().compile()


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("heads", sorted(QWEN3_4B))
@pytest.mark.parametrize("chip", sorted(TPU_TOPOLOGIES))
def test_tpu_kernel_compiles_at_qwen3_4b_decode_shapes(chip, heads, kv_dtype):
    """The kernel reads the 8-bit pools themselves (no dequantized pool anywhere) within 16 MiB of
    scoped VMEM."""
    num_heads, num_kv_heads = QWEN3_4B[heads]
    text = compile_for_tpu(chip, num_heads, num_kv_heads, kv_dtype).as_text()
    (kernel,) = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert "paged_attention" in kernel.split("=")[0]
    pool = f"{num_kv_heads},{POOL_PAGES},{PAGE_SIZE},{HEAD_DIM}"
    storage = {jnp.int8: "s8", jnp.float8_e4m3fn: "f8e4m3fn"}[kv_dtype]
    operands = kernel.split("operand_layout_constraints=")[1]
    assert operands.count(f"{storage}[{pool}]") == 2  # k_pages and v_pages as they are
    assert not re.search(rf"\b(f32|bf16|f16)\[{pool}\]", text)
    (used,) = re.findall(r'"used_scoped_memory_configs":\[\{[^]]*"size":"(\d+)"', kernel)
    assert int(used) <= 16 * 2**20
