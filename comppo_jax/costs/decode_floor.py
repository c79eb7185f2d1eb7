"""The least a rollout's decoding can cost per chip in each decode layout, and the layout `auto`
picks by it (comppo_jax.train.decode_layout builds the layouts; `decode_candidates` is all it reads).

`decode_floor`: a decode step must read its share of the weights and of the live KV cache (rows
of mean context, prompt + half the response) from HBM, in the dtypes the rollout stores them in
(rollout.weight_dtype, rollout.kv_dtype), and a tensor-parallel group of G > 1
chips pays the latency of its per-layer collectives (two all-reduces per layer). `auto` takes the
G with the smallest floor among those whose decode weights and page pool fit beside the state
already in HBM. `launch/plan.py` sets the floor beside the compiled sampler's own prediction.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from comppo_jax import sharding
from comppo_jax.costs import hlo_cost
from comppo_jax.costs.chips import Chip, peak_flops, published_chip
from comppo_jax.models import paged_cache, quantize
from comppo_jax.models.config import ModelConfig
from comppo_jax.models.transformer import param_shapes
from comppo_jax.rollout import engine


def decode_group_sizes(config: ModelConfig, devices: int) -> list[int]:
    """`sharding.decode_group_sizes` of a model on `devices`."""
    return sharding.decode_group_sizes(config.num_heads, config.num_kv_heads, devices)


def pool_heads_per_chip(config: ModelConfig, tensor: int) -> int:
    """Kv heads of the page pool one chip of a group of `tensor` holds."""
    repeat = tensor // config.num_kv_heads if tensor > config.num_kv_heads and tensor % config.num_kv_heads == 0 else 1
    heads = config.num_kv_heads * repeat
    return heads // tensor if heads % tensor == 0 and config.num_heads % tensor == 0 else heads


def weight_bytes_per_chip(config: ModelConfig, tensor: int, weight_dtype: str = "auto") -> tuple[int, int]:
    """(bytes of the sampler's weights (`rollout.weight_dtype`; "auto": the compute dtype) one chip
    of a group of `tensor` holds, of those a decode step reads: all but an untied embedding table,
    of which it reads a row per token). 8-bit matrices count a byte per weight and their float32
    per-output-channel scales."""
    mesh = jax.sharding.AbstractMesh((1, 1, tensor), sharding.AXES)
    compute = jnp.dtype(config.dtype).itemsize
    held = read = 0
    for path, shape in jax.tree_util.tree_flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )[0]:
        name = path[-1].key
        local = NamedSharding(mesh, sharding.leaf_spec(mesh, path, shape)).shard_shape(shape)
        if weight_dtype == "int8" and name in quantize.OUTPUT_AXIS:
            channels = local[quantize.OUTPUT_AXIS[name]]
            size = math.prod(local) + 4 * channels * (local[0] if len(local) == 3 else 1)
        else:
            itemsize = compute if weight_dtype in ("auto", "int8") else jnp.dtype(weight_dtype).itemsize
            size = math.prod(local) * itemsize
        held += size
        untied_embedding = name == "embed" and not config.tie_word_embeddings
        read += 0 if untied_embedding else size
    return held, read


def kv_bytes_per_position(config: ModelConfig, tensor: int, kv_dtype: str = "auto") -> int:
    """Bytes of one context position's keys and values, all layers, on one chip of a group of
    `tensor` (`rollout.kv_dtype`: 8-bit pages with a float32 scale per token and kv head)."""
    name = paged_cache.kv_dtype(kv_dtype, config.dtype)
    per_head = config.head_dim * jnp.dtype(name).itemsize + (4 if name in quantize.LARGEST else 0)
    return config.num_layers * 2 * pool_heads_per_chip(config, tensor) * per_head


class DecodeFloor(NamedTuple):
    """The least one rollout's decoding costs per chip in a decode layout (module docstring)."""

    tensor: int  # G
    replicas: int  # devices / G
    weight_bytes: float  # read per token step
    kv_bytes: float  # read per token step: the live cache's share at mean context
    collective_hops: float  # per token step: two all-reduces per layer, the embedding's and the logits'
    step_seconds: float  # one token step
    steps: int  # token steps of the rollout (every row to max_new_tokens)
    memory_bytes: float  # held while decoding: the decode weights and the page pool

    @property
    def seconds(self) -> float:
        return self.step_seconds * self.steps


def decode_floor(
    config: ModelConfig,
    chip: Chip,
    *,
    devices: int,
    tensor: int,
    num_prompts: int,
    samples: int,
    prompt_length: int,
    max_new_tokens: int,
    page_size: int,
    decode_slots: int | None,
    kv_dtype: str = "auto",
    weight_dtype: str = "auto",
) -> DecodeFloor:
    """`DecodeFloor` of G = `tensor` on `devices` chips for one rollout of `num_prompts` x `samples`
    rows, its pages and weights in `kv_dtype` and `weight_dtype` (rollout.kv_dtype, .weight_dtype)."""
    replicas = devices // tensor
    layout = engine.make_layout(
        num_prompts,
        prompt_length,
        num_samples=samples,
        max_new_tokens=max_new_tokens,
        page_size=page_size,
        decode_slots=decode_slots,
        shards=replicas,
    )
    held, read = weight_bytes_per_chip(config, tensor, weight_dtype)
    kv_per_position = kv_bytes_per_position(config, tensor, kv_dtype)
    kv = layout.slots * (prompt_length + max_new_tokens / 2) * kv_per_position
    pool = layout.pages_per_layer * page_size * kv_per_position
    # Two all-reduces per layer (the row-parallel attention output and MLP), the embedding lookup's, the logits' gather.
    hops = (2 * config.num_layers + 1) * hlo_cost.ring_steps("all-reduce", tensor) + hlo_cost.ring_steps(
        "all-gather", tensor
    )
    # Each live row passes through this chip's weights once (8-bit weights are multiplied in the compute dtype).
    flops = 2 * layout.slots * weight_bytes_per_chip(config, tensor)[0] / jnp.dtype(config.dtype).itemsize
    step = max(flops / peak_flops(chip, config.dtype), (read + kv) / chip.hbm_bytes) + hops * chip.hop_latency
    return DecodeFloor(
        tensor, replicas, float(read), float(kv), float(hops), step, layout.decode_steps, float(held + pool)
    )


def floors(config: ModelConfig, chip: Chip, devices: int, **rollout) -> list[DecodeFloor]:
    """`decode_floor` of every G `decode_group_sizes` allows."""
    return [
        decode_floor(config, chip, devices=devices, tensor=g, **rollout) for g in decode_group_sizes(config, devices)
    ]


def fastest(candidates: list[DecodeFloor], budget: float | None) -> DecodeFloor:
    """The candidate with the smallest floor among those within `budget` bytes per chip (None: no
    limit), the smaller G on ties; if none fits, the one holding the least."""
    fitting = [c for c in candidates if budget is None or c.memory_bytes <= budget]
    if not fitting:
        return min(candidates, key=lambda c: (c.memory_bytes, c.tensor))
    return min(fitting, key=lambda c: (round(c.seconds, 9), c.tensor))


def local_chip_and_budget() -> tuple[Chip | None, float | None]:
    """The published peaks of this process's devices (None on CPU), and 90% of the HBM its first
    device has free now, the least over processes (None where devices report no limit)."""
    chip = published_chip(jax.local_devices()[0].device_kind)
    stats = jax.local_devices()[0].memory_stats() or {}
    free = stats["bytes_limit"] - stats["bytes_in_use"] if "bytes_limit" in stats else -1
    free = sharding.min_over_processes(int(free))  # every process must choose the same layout
    return chip, (0.9 * free if free >= 0 else None)


def decode_candidates(
    config: ModelConfig, devices: int, rollout: dict, target: tuple[Chip | None, float | None] | None = None
) -> tuple[tuple[DecodeFloor, ...], DecodeFloor | None]:
    """(every G's `decode_floor` on `devices` chips, auto's choice among them: `fastest`) for one
    rollout shaped `rollout` (`decode_layout.rollout_shapes`), on `target` = (chip, bytes per chip
    free for the decode weights and page pool, None: unknown), or the local devices' when None
    (`local_chip_and_budget`). ((), None) on a chip without published peaks (CPU)."""
    chip, budget = local_chip_and_budget() if target is None else target
    if chip is None:
        return (), None
    candidates = tuple(floors(config, chip, devices, **rollout))
    return candidates, fastest(list(candidates), budget)
