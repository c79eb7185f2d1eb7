"""`attention_with_concentration` against the platform's plain causal attention, side by side.

Qwen3-4B final-layer dims (q/kv heads and head dim from configs/qwen3_4b.py), bf16, right-padded
rows, the concentration window starting at L/4 (a prompt). The baseline is
`jax.nn.dot_product_attention(is_causal=True)` with the same key lengths (cuDNN on GPU, XLA
elsewhere); it computes no concentration. A third program is the kernel with every optional
statistic (`pallas_kernels.STATISTICS`), timed against the Herfindahl-only kernel (goal: at most
1.1x in time and memory). Memory is each compiled program's temp + output bytes
(`memory_analysis()`). On CPU the kernel runs interpreted (a correctness mode), so the CPU
default lengths are small and its times say nothing about TPU/GPU speed.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import interleaved_medians, print_table
from comppo_jax.models import preset_model_config
from pallas_kernels import STATISTICS, attention_with_concentration, default_backend

ACCELERATOR_LENGTHS = (4096, 16384)
CPU_LENGTHS = (512, 1024)


def _inputs(batch, length, config, seed=0):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, length, config.num_heads, config.head_dim), jnp.bfloat16)
    k, v = (
        jax.random.normal(key, (batch, length, config.num_kv_heads, config.head_dim), jnp.bfloat16) for key in keys[1:]
    )
    lengths = rng.integers(3 * length // 4, length + 1, batch).astype(np.int32)
    mask = np.arange(length)[None] < lengths[:, None]
    return q, k, v, jnp.asarray(mask), jnp.asarray(lengths), jnp.full((batch,), length // 4, jnp.int32)


def _megabytes(compiled) -> float:
    memory = compiled.memory_analysis()
    return (memory.temp_size_in_bytes + memory.output_size_in_bytes) / 2**20


def run(batch: int = 1, length: int | None = None, repeats: int = 5) -> list[dict]:
    config = preset_model_config("qwen3_4b")
    platform = jax.default_backend()
    backend = default_backend()
    implementation = "cudnn" if platform == "gpu" else None
    lengths = (length,) if length else (CPU_LENGTHS if platform == "cpu" else ACCELERATOR_LENGTHS)
    plain_name = f"dot_product_attention ({implementation or 'xla'})"
    kernel_name = f"attention_with_concentration ({backend})"
    statistics_name = f"{kernel_name} + {', '.join(STATISTICS)}"

    rows = []
    for seq in lengths:
        q, k, v, mask, key_lengths, window_start = _inputs(batch, seq, config)
        plain = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation))
        kernel = jax.jit(functools.partial(attention_with_concentration, backend=backend))
        every_statistic = jax.jit(
            functools.partial(attention_with_concentration, backend=backend, statistics=STATISTICS)
        )
        plain_args = (q, k, v)
        plain_kwargs = dict(key_value_seq_lengths=key_lengths)
        memory = {
            plain_name: _megabytes(plain.lower(*plain_args, **plain_kwargs).compile()),
            kernel_name: _megabytes(kernel.lower(q, k, v, mask, window_start).compile()),
            statistics_name: _megabytes(every_statistic.lower(q, k, v, mask, window_start).compile()),
        }
        medians = interleaved_medians(
            {
                plain_name: lambda: plain(*plain_args, **plain_kwargs).block_until_ready(),
                kernel_name: lambda: jax.block_until_ready(kernel(q, k, v, mask, window_start)),
                statistics_name: lambda: jax.block_until_ready(every_statistic(q, k, v, mask, window_start)),
            },
            repeats,
        )
        for name, seconds in medians.items():
            rows.append(
                {
                    "L": str(seq),
                    "program": name,
                    "ms": f"{seconds * 1e3:.2f}",
                    "vs plain": f"{seconds / medians[plain_name]:.2f}x",
                    "vs H only": f"{seconds / medians[kernel_name]:.2f}x" if name != plain_name else "",
                    "memory MiB": f"{memory[name]:.1f}",
                }
            )
    print(
        f"batch {batch}, {config.num_heads} q heads, {config.num_kv_heads} kv heads, head dim {config.head_dim}, bf16; "
        f"median of {repeats} interleaved rounds; jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({platform}), {os.cpu_count()} CPU cores"
    )
    print_table(rows, ["L", "program", "ms", "vs plain", "vs H only", "memory MiB"])
    return rows
