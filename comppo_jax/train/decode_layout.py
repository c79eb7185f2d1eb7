"""The rollout's decode layout: where the sampler's weights live while it decodes.

Training keeps every weight split over `fsdp` x `tensor` (comppo_jax.sharding). Decoding on that
layout gathers every layer's weights over `fsdp` again at every token step. The decode layout is
a mesh of the same devices, `sharding.decode_mesh`: (data = devices / G, fsdp = 1, tensor = G).
Each weight is split G ways within a group of G chips (Megatron tensor parallelism: two
all-reduces of one token's activations per layer) and the group is replicated over the rest; the
rows split over the replicas, and each replica's KV page pool over kv heads within its group.
Once per train step one program (`DecodeLayout.sampler_params`) casts the actor to the compute
dtype and moves it into that layout; the generation moves back to the training mesh
(`DecodeLayout.to_training`). Nothing is gathered per token.

`rollout.mesh.tensor` picks G: a number, "train" (decode on the training mesh, no resharding) or
"auto", the G whose `decode_floor` is smallest on the chip (`cost.CHIPS`' published peaks) among
those whose decode weights and page pool fit beside the state already in HBM. On a platform
without published peaks (CPU) "auto" keeps the training mesh's tensor axis, replicated over
data x fsdp.

`decode_floor` is the least a decode step can cost per chip: it must read its share of the
weights and of the live KV cache (rows of mean context, prompt + half the response) from HBM, and
a group of G > 1 chips pays the latency of its per-layer collectives. `launch/plan.py` sets it
beside the compiled sampler's own prediction.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from comppo_jax import sharding
from comppo_jax.models import ConfigError, lora, model_config
from comppo_jax.models.config import ModelConfig
from comppo_jax.models.transformer import param_shapes
from comppo_jax.rollout import engine, engine_options
from comppo_jax.train import cost as costs
from comppo_jax.train.update import cast_params

MODES = ("auto", "train")
# The prompt length `auto` assumes when it chooses (the responses dominate the cache at 4-16K).
PLANNED_PROMPT_LENGTH = 512


def parse_tensor(value) -> str | int:
    """rollout.mesh.tensor as "auto", "train" or a positive int; ValueError otherwise."""
    text = str(value).strip()
    if text in MODES:
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"rollout.mesh.tensor={value!r}: expected auto, train or a positive number of devices per group")


def checked_tensor(value, config: ModelConfig, devices: int) -> str | int:
    """`parse_tensor(value)`, a group size refused with a ConfigError naming the ones `devices` allow."""
    choice = parse_tensor(value)
    allowed = group_sizes(config, devices)
    if choice not in MODES and choice not in allowed:
        raise ConfigError(
            f"config.rollout.mesh.tensor={choice}: a decode group must divide the {devices} devices and the "
            f"{config.num_heads} query heads and divide or be a multiple of the {config.num_kv_heads} kv heads; "
            f"here: {', '.join(map(str, allowed))} (or auto, train)"
        )
    return choice


def check_config(cfg, mesh: Mesh, rollout_devices: list | None = None) -> None:
    """Refuses a run config's rollout.mesh.tensor that `mesh` (or the rollout stage's own
    devices) cannot take, before anything loads."""
    checked_tensor(
        cfg.rollout.mesh.tensor, model_config(cfg.model), len(rollout_devices) if rollout_devices else mesh.devices.size
    )
    if rollout_devices and jax.process_count() > 1 and len(rollout_devices) != mesh.devices.size:
        raise ConfigError(
            f"config.mesh.rollout_devices={cfg.mesh.rollout_devices}: a multi-process run needs as many rollout "
            f"devices as training devices ({len(rollout_devices)} vs {mesh.devices.size}): the weights move between "
            "the two sets shard by shard (sharding.move); pass half of each process's devices"
        )


def group_sizes(config: ModelConfig, devices: int) -> list[int]:
    """The G a decode layout can take on `devices`: dividing the devices and the query heads, and
    dividing the kv heads or a multiple of them (each chip then keeps the kv head its queries read,
    `sharding.kv_head_repeat`)."""
    return [
        g
        for g in range(1, devices + 1)
        if devices % g == 0
        and config.num_heads % g == 0
        and (config.num_kv_heads % g == 0 or g % config.num_kv_heads == 0)
    ]


def pool_heads_per_chip(config: ModelConfig, tensor: int) -> int:
    """Kv heads of the page pool one chip of a group of `tensor` holds."""
    repeat = tensor // config.num_kv_heads if tensor > config.num_kv_heads and tensor % config.num_kv_heads == 0 else 1
    heads = config.num_kv_heads * repeat
    return heads // tensor if heads % tensor == 0 and config.num_heads % tensor == 0 else heads


def weight_bytes_per_chip(config: ModelConfig, tensor: int) -> tuple[int, int]:
    """(bytes of the compute-dtype weights one chip of a group of `tensor` holds, of those a
    decode step reads: all but an untied embedding table, of which it reads a row per token)."""
    mesh = jax.sharding.AbstractMesh((1, 1, tensor), sharding.AXES)
    itemsize = jnp.dtype(config.dtype).itemsize
    held = read = 0
    for path, shape in jax.tree_util.tree_flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )[0]:
        size = math.prod(NamedSharding(mesh, sharding.leaf_spec(mesh, path, shape)).shard_shape(shape)) * itemsize
        held += size
        untied_embedding = path[-1].key == "embed" and not config.tie_word_embeddings
        read += 0 if untied_embedding else size
    return held, read


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
    chip: costs.Chip,
    *,
    devices: int,
    tensor: int,
    num_prompts: int,
    samples: int,
    prompt_length: int,
    max_new_tokens: int,
    page_size: int,
    decode_slots: int | None,
) -> DecodeFloor:
    """`DecodeFloor` of G = `tensor` on `devices` chips for one rollout of `num_prompts` x `samples` rows."""
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
    itemsize = jnp.dtype(config.dtype).itemsize
    held, read = weight_bytes_per_chip(config, tensor)
    kv_per_position = config.num_layers * 2 * pool_heads_per_chip(config, tensor) * config.head_dim * itemsize
    kv = layout.slots * (prompt_length + max_new_tokens / 2) * kv_per_position
    pool = layout.pages_per_layer * page_size * kv_per_position
    # Two all-reduces per layer (the row-parallel attention output and MLP), the embedding lookup's, the logits' gather.
    hops = (2 * config.num_layers + 1) * costs.ring_steps("all-reduce", tensor) + costs.ring_steps("all-gather", tensor)
    flops = 2 * layout.slots * held / itemsize  # each live row passes through this chip's weights once
    step = max(flops / costs.peak_flops(chip, config.dtype), (read + kv) / chip.hbm_bytes) + hops * chip.hop_latency
    return DecodeFloor(
        tensor, replicas, float(read), float(kv), float(hops), step, layout.decode_steps, float(held + pool)
    )


def floors(config: ModelConfig, chip: costs.Chip, devices: int, **rollout) -> list[DecodeFloor]:
    """`decode_floor` of every G `group_sizes` allows."""
    return [decode_floor(config, chip, devices=devices, tensor=g, **rollout) for g in group_sizes(config, devices)]


def fastest(candidates: list[DecodeFloor], budget: float | None) -> DecodeFloor:
    """The candidate with the smallest floor among those within `budget` bytes per chip (None: no
    limit), the smaller G on ties; if none fits, the one holding the least."""
    fitting = [c for c in candidates if budget is None or c.memory_bytes <= budget]
    if not fitting:
        return min(candidates, key=lambda c: (c.memory_bytes, c.tensor))
    return min(fitting, key=lambda c: (round(c.seconds, 9), c.tensor))


def rollout_shapes(cfg, prompt_length: int = PLANNED_PROMPT_LENGTH) -> dict:
    """`decode_floor`'s rollout keywords for a run config."""
    options = engine_options(cfg.rollout)
    return dict(
        num_prompts=cfg.rollout.prompts_per_step,
        samples=cfg.rollout.samples_per_prompt,
        prompt_length=prompt_length,
        max_new_tokens=cfg.rollout.max_new_tokens,
        page_size=options["page_size"],
        decode_slots=options["decode_slots"],
    )


class DecodeLayout(NamedTuple):
    """Where a run's sampler decodes (module docstring)."""

    mesh: Mesh  # the sampler's mesh (the training mesh itself when `resharded` is False)
    tensor: int  # G, the tensor-parallel group
    resharded: bool  # False: the sampler reads the training layout (rollout.mesh.tensor=train, or the same layout)
    reshard: Callable  # actor -> the sampler's params, cast to the compute dtype, in the decode layout
    floor: DecodeFloor | None  # G's floor on the run's chip (None: no published peaks)
    candidates: tuple = ()  # every G's floor, as auto compared them
    separate: bool = False  # the decode mesh is the rollout stage's own devices (mesh.rollout_devices)

    def replicated(self, tree):
        """Small inputs (the sampling key) on every device of the decode mesh."""
        if not self.resharded:
            return tree
        target = NamedSharding(self.mesh, P())
        return sharding.move(tree, target) if self.separate else jax.device_put(tree, target)

    def to_training(self, tree, train_mesh: Mesh):
        """A generation (rows first in every field) on the training mesh's batch sharding."""
        if not self.resharded:
            return tree
        rows = sharding.batch_sharding(train_mesh)
        return sharding.move(tree, jax.tree.map(lambda _: rows, tree)) if self.separate else jax.device_put(tree, rows)


def decode_weights(actor, config: ModelConfig):
    """The weights the sampler decodes with: the actor in the compute dtype, LoRA adapters merged
    into their base weights (one matmul per projection and token instead of three)."""
    return cast_params(lora.merged(actor, config), config.dtype)


def _chosen_group(value, mesh: Mesh, config: ModelConfig, devices: int, *, chip, budget, rollout: dict, fallback: int):
    """(the checked choice, G, G's floor or None, every G's floor) of rollout.mesh.tensor=`value` on
    `devices` chips: auto takes the fastest floor that fits `budget` (`fallback` on a chip without
    published peaks), train the training mesh's tensor axis."""
    choice = checked_tensor(value, config, devices)
    candidates = tuple(floors(config, chip, devices, **rollout)) if chip is not None else ()
    if choice == "auto":
        tensor = fastest(list(candidates), budget).tensor if candidates else fallback
    elif choice == "train":
        tensor = mesh.shape["tensor"]
    else:
        tensor = choice
    return choice, tensor, next((c for c in candidates if c.tensor == tensor), None), candidates


def make_decode_layout(
    value,
    mesh: Mesh,
    config: ModelConfig,
    actor,
    *,
    chip: costs.Chip | None,
    budget: float | None,
    rollout: dict,
    rollout_devices: list | None = None,
) -> DecodeLayout:
    """The decode layout `value` (rollout.mesh.tensor) names on `mesh` for params shaped like
    `actor` (arrays or ShapeDtypeStructs; any dtype); `chip`, `budget` (bytes per chip free for
    the decode weights and page pool, None: unknown) and `rollout` (`rollout_shapes`) settle auto.
    With `rollout_devices` (mesh.rollout_devices) the layout is on those devices instead."""
    if rollout_devices:
        return _separate_layout(
            value, mesh, config, actor, chip=chip, budget=budget, rollout=rollout, devices=rollout_devices
        )
    devices = mesh.devices.size
    choice, tensor, floor, candidates = _chosen_group(
        value, mesh, config, devices, chip=chip, budget=budget, rollout=rollout, fallback=mesh.shape["tensor"]
    )
    same = dict(mesh.shape) == {"data": devices // tensor, "fsdp": 1, "tensor": tensor}
    weights = functools.partial(decode_weights, config=config)
    if (
        choice == "train" or same
    ):  # a LoRA actor's merge is one program; a cast to the same dtype returns the arrays themselves
        return DecodeLayout(
            mesh, tensor, False, jax.jit(weights) if lora.has_adapters(actor) else weights, floor, candidates
        )
    decode = sharding.decode_mesh(mesh, tensor)
    reshard = jax.jit(weights, out_shardings=sharding.tree_shardings(decode, jax.eval_shape(weights, actor)))
    return DecodeLayout(decode, tensor, True, reshard, floor, candidates)


def _separate_layout(
    value, mesh: Mesh, config: ModelConfig, actor, *, chip, budget, rollout: dict, devices: list
) -> DecodeLayout:
    """The decode layout on the rollout stage's own `devices`. After each update the weights move
    there in one transfer: cast to the compute dtype on the training mesh, then copied device to
    device (`sharding.move`); across processes they are first laid out on the training devices
    exactly as on their rollout twins, so each process copies only its own shards."""
    choice, tensor, floor, candidates = _chosen_group(
        value, mesh, config, len(devices), chip=chip, budget=budget, rollout=rollout, fallback=1
    )
    if choice == "train" and tensor not in group_sizes(config, len(devices)):
        raise ConfigError(
            f"config.rollout.mesh.tensor=train: the training mesh's tensor axis {tensor} does not divide the "
            f"{len(devices)} rollout devices (mesh.rollout_devices); pass a group size or auto"
        )
    decode = sharding.decode_mesh(Mesh(np.asarray(devices).reshape(len(devices), 1, 1), sharding.AXES), tensor)
    weights = functools.partial(decode_weights, config=config)
    compute = jax.eval_shape(weights, actor)
    target = sharding.tree_shardings(decode, compute)
    if jax.process_count() == 1:
        cast = jax.jit(weights)
    else:  # the decode layout on the training devices (the twins of the rollout devices, position by position)
        twin = Mesh(mesh.devices.reshape(-1).reshape(decode.devices.shape), sharding.AXES)
        cast = jax.jit(weights, out_shardings=sharding.tree_shardings(twin, compute))
    return DecodeLayout(
        decode, tensor, True, lambda actor: sharding.move(cast(actor), target), floor, candidates, separate=True
    )


def local_chip_and_budget(mesh: Mesh) -> tuple[costs.Chip | None, float | None]:
    """The published peaks of the mesh's devices (None on CPU), and 90% of the HBM a device has
    free now, the least over processes (None where devices report no limit)."""
    chip = costs.published_chip(mesh.devices.flat[0].device_kind)
    stats = jax.local_devices()[0].memory_stats() or {}
    free = stats["bytes_limit"] - stats["bytes_in_use"] if "bytes_limit" in stats else -1
    free = sharding.min_over_processes(int(free))  # every process must choose the same layout
    return chip, (0.9 * free if free >= 0 else None)


def for_run(cfg, mesh: Mesh, config: ModelConfig, actor, rollout_devices: list | None = None) -> DecodeLayout:
    """The decode layout of a run (`rollout.mesh.tensor`), on the devices of its training mesh or
    on the rollout stage's own (`rollout_devices`, mesh.rollout_devices)."""
    chip, budget = local_chip_and_budget(mesh)
    return make_decode_layout(
        cfg.rollout.mesh.tensor,
        mesh,
        config,
        actor,
        chip=chip,
        budget=budget,
        rollout=rollout_shapes(cfg),
        rollout_devices=rollout_devices,
    )


def describe(layout: DecodeLayout) -> str:
    """One line: the layout, and its floor where the chip is known."""
    devices = layout.mesh.devices.size
    text = (
        f"tensor-parallel groups of {layout.tensor}, {devices // layout.tensor} replica(s)"
        if layout.resharded
        else f"the training mesh {dict(layout.mesh.shape)}"
    )
    if layout.separate:
        text += f" on the rollout stage's own {devices} devices"
    if layout.floor is not None:
        text += (
            f"; decode floor {layout.floor.seconds:.3g} s per rollout "
            f"({layout.floor.step_seconds * 1e3:.3g} ms per token step)"
        )
    return text
