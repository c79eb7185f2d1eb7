"""The rollout's decode layout: where the sampler's weights live while it decodes.

Training keeps every weight split over `fsdp` x `tensor` (comppo_jax.sharding). Decoding on that
layout gathers every layer's weights over `fsdp` again at every token step. The decode layout is
a mesh of the same devices, `sharding.decode_mesh`: (data = devices / G, fsdp = 1, tensor = G).
Each weight is split G ways within a group of G chips (Megatron tensor parallelism: two
all-reduces of one token's activations per layer) and the group is replicated over the rest; the
rows split over the replicas, and each replica's KV page pool over kv heads within its group.
Once per train step one program (`DecodeLayout.sampler_params`) casts the actor to the compute
dtype (or quantizes it to 8 bits, rollout.weight_dtype=int8) and moves it into that layout; the
generation moves back to the training mesh (`DecodeLayout.to_training`). Nothing is gathered per token.

`rollout.mesh.tensor` picks G: a number, "train" (decode on the training mesh, no resharding) or
"auto", the G whose decode floor is smallest on the chip among those whose decode weights and
page pool fit beside the state already in HBM (comppo_jax.costs.decode_floor, the one piece of
the planner a run reads). On a platform without published peaks (CPU) "auto" keeps the training
mesh's tensor axis, replicated over data x fsdp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from comppo_jax import sharding
from comppo_jax.costs.decode_floor import decode_candidates
from comppo_jax.models import ConfigError, lora, model_config
from comppo_jax.models.config import ModelConfig
from comppo_jax.models.quantize import sampler_weights
from comppo_jax.train.specs import RolloutStageSpec

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
    allowed = sharding.decode_group_sizes(config.num_heads, config.num_kv_heads, devices)
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


def rollout_shapes(spec: RolloutStageSpec, prompt_length: int = PLANNED_PROMPT_LENGTH) -> dict:
    """The decode floor's rollout keywords for a run's rollout stage."""
    rollout = spec.experience.rollout
    return dict(
        num_prompts=spec.prompts_per_step,
        samples=rollout.samples_per_prompt,
        prompt_length=prompt_length,
        max_new_tokens=rollout.max_new_tokens,
        page_size=rollout.page_size,
        decode_slots=rollout.decode_slots,
        kv_dtype=rollout.kv_dtype,
        weight_dtype=rollout.weight_dtype,
    )


class DecodeLayout(NamedTuple):
    """Where a run's sampler decodes (module docstring)."""

    mesh: Mesh  # the sampler's mesh (the training mesh itself when `resharded` is False)
    tensor: int  # G, the tensor-parallel group
    resharded: bool  # False: the sampler reads the training layout (rollout.mesh.tensor=train, or the same layout)
    reshard: Callable  # actor -> the sampler's params in rollout.weight_dtype, in the decode layout
    floor: Any  # G's comppo_jax.costs DecodeFloor on the run's chip (None: no published peaks)
    candidates: tuple = ()  # every G's floor, as auto compared them
    separate: bool = False  # the decode mesh is the rollout stage's own devices (mesh.rollout_devices)
    # actor -> its compute-dtype copy in the decode layout, where the sampler's weights are in
    # another dtype (rollout.weight_dtype); None: `reshard` makes that copy
    compute_reshard: Callable | None = None

    @property
    def evaluation_weights(self) -> Callable:
        """actor -> the weights evaluations decode with: the compute-dtype copy, whatever the
        sampler's dtype (accuracy is the policy's, not its 8-bit sampler's)."""
        return self.compute_reshard or self.reshard

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


def decode_weights(actor, config: ModelConfig, weight_dtype: str = "auto"):
    """The weights the sampler decodes with: the actor in `weight_dtype` (rollout.weight_dtype;
    "auto": the compute dtype, "int8": quantized per output channel, `quantize.sampler_weights`),
    LoRA adapters merged into their base weights (one matmul per projection and token instead of three)."""
    return sampler_weights(lora.merged(actor, config), weight_dtype, config.dtype)


def _chosen_group(value, mesh: Mesh, config: ModelConfig, devices: int, *, target, rollout: dict, fallback: int):
    """(the checked choice, G, G's floor or None, every G's floor) of rollout.mesh.tensor=`value` on
    `devices` chips: auto takes the fastest floor that fits (`fallback` on a chip without published
    peaks), train the training mesh's tensor axis. `target`: `decode_candidates`' (None: the local chip)."""
    choice = checked_tensor(value, config, devices)
    candidates, fastest = decode_candidates(config, devices, rollout, target)
    if choice == "auto":
        tensor = fastest.tensor if fastest is not None else fallback
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
    rollout: dict,
    target=None,
    rollout_devices: list | None = None,
) -> DecodeLayout:
    """The decode layout `value` (rollout.mesh.tensor) names on `mesh` for params shaped like
    `actor` (arrays or ShapeDtypeStructs; any dtype); `rollout` (`rollout_shapes`) and `target`
    (chip, bytes per chip free for the decode weights and page pool; None: this process's devices)
    settle auto.
    With `rollout_devices` (mesh.rollout_devices) the layout is on those devices instead."""
    if rollout_devices:
        return _separate_layout(value, mesh, config, actor, target=target, rollout=rollout, devices=rollout_devices)
    devices = mesh.devices.size
    choice, tensor, floor, candidates = _chosen_group(
        value, mesh, config, devices, target=target, rollout=rollout, fallback=mesh.shape["tensor"]
    )
    in_place = choice == "train" or dict(mesh.shape) == {"data": devices // tensor, "fsdp": 1, "tensor": tensor}
    decode = mesh if in_place else sharding.decode_mesh(mesh, tensor)

    def program(weight_dtype: str) -> Callable:
        weights = functools.partial(decode_weights, config=config, weight_dtype=weight_dtype)
        if not in_place:
            return jax.jit(weights, out_shardings=sharding.tree_shardings(decode, jax.eval_shape(weights, actor)))
        # A LoRA merge or a quantization is one program; a cast to the same dtype returns the arrays themselves.
        return jax.jit(weights) if lora.has_adapters(actor) or weight_dtype == "int8" else weights

    reshard, compute_reshard = _programs(program, config, rollout)
    return DecodeLayout(decode, tensor, not in_place, reshard, floor, candidates, compute_reshard=compute_reshard)


def _programs(
    program: Callable[[str], Callable], config: ModelConfig, rollout: dict
) -> tuple[Callable, Callable | None]:
    """(the sampler's reshard, the compute-dtype one where rollout.weight_dtype is another dtype, else None)."""
    weight_dtype = rollout.get("weight_dtype", "auto")
    exact = weight_dtype in ("auto", jnp.dtype(config.dtype).name)
    return program(weight_dtype), None if exact else program("auto")


def _separate_layout(
    value, mesh: Mesh, config: ModelConfig, actor, *, target, rollout: dict, devices: list
) -> DecodeLayout:
    """The decode layout on the rollout stage's own `devices`. After each update the weights move
    there in one transfer: cast to the compute dtype on the training mesh, then copied device to
    device (`sharding.move`); across processes they are first laid out on the training devices
    exactly as on their rollout twins, so each process copies only its own shards."""
    choice, tensor, floor, candidates = _chosen_group(
        value, mesh, config, len(devices), target=target, rollout=rollout, fallback=1
    )
    if choice == "train" and tensor not in sharding.decode_group_sizes(
        config.num_heads, config.num_kv_heads, len(devices)
    ):
        raise ConfigError(
            f"config.rollout.mesh.tensor=train: the training mesh's tensor axis {tensor} does not divide the "
            f"{len(devices)} rollout devices (mesh.rollout_devices); pass a group size or auto"
        )
    decode = sharding.decode_mesh(Mesh(np.asarray(devices).reshape(len(devices), 1, 1), sharding.AXES), tensor)

    def program(weight_dtype: str) -> Callable:
        weights = functools.partial(decode_weights, config=config, weight_dtype=weight_dtype)
        compute = jax.eval_shape(weights, actor)
        target = sharding.tree_shardings(decode, compute)
        if jax.process_count() == 1:
            cast = jax.jit(weights)
        else:  # the decode layout on the training devices (the twins of the rollout devices, position by position)
            twin = Mesh(mesh.devices.reshape(-1).reshape(decode.devices.shape), sharding.AXES)
            cast = jax.jit(weights, out_shardings=sharding.tree_shardings(twin, compute))
        return lambda actor: sharding.move(cast(actor), target)

    reshard, compute_reshard = _programs(program, config, rollout)
    return DecodeLayout(
        decode, tensor, True, reshard, floor, candidates, separate=True, compute_reshard=compute_reshard
    )


def for_run(
    spec: RolloutStageSpec, mesh: Mesh, config: ModelConfig, actor, rollout_devices: list | None = None
) -> DecodeLayout:
    """The decode layout of a run's rollout stage (`rollout.mesh.tensor`), on the devices of its
    training mesh or on the rollout stage's own (`rollout_devices`, mesh.rollout_devices)."""
    return make_decode_layout(
        spec.decode_tensor,
        mesh,
        config,
        actor,
        rollout=rollout_shapes(spec),
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
