"""Device mesh and sharding rules, all in one place (maxtext-style logical rules).

The mesh has three axes:
- `data`: pure data parallelism (params replicated along it);
- `fsdp`: data parallelism whose params and optimizer states are sharded along it (ZeRO-3);
- `tensor`: Megatron tensor parallelism (attention heads, MLP width, vocabulary).

Batches are split over `data` x `fsdp`. A weight's rule names the mesh axis of each dimension;
a dimension whose size the axis does not divide stays replicated. Everything not named by a
rule (norms, the TAC critic's ~2M params, optimizer counters, knobs) is replicated. The rules
match a leaf by its nearest dict key, so the same rule shards a weight and its AdamW moments.

Multi-host: `initialize_distributed` calls `jax.distributed.initialize` when configured. Every
host builds the same global batch from the same seeds, and `to_host` gathers sharded arrays
for the host-side steps (decoding, the verifier). `split_over_processes` splits host work whose
result may differ between hosts (the verifier's timeouts) so that it is done once and shared.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the batch dimension is split over both data-parallel axes

# Weight name -> mesh axis per dimension. Layer weights are stacked [num_layers, in, out].
PARAM_RULES: dict[str, tuple] = {
    "embed": ("tensor", "fsdp"),  # [V, D]
    "lm_head": ("fsdp", "tensor"),  # [D, V]
    "q_proj": (None, "fsdp", "tensor"),
    "k_proj": (None, "fsdp", "tensor"),
    "v_proj": (None, "fsdp", "tensor"),
    "o_proj": (None, "tensor", "fsdp"),
    "gate_proj": (None, "fsdp", "tensor"),
    "up_proj": (None, "fsdp", "tensor"),
    "down_proj": (None, "tensor", "fsdp"),
}
# A LoRA adapter follows its base weight: A [N, in, r] splits `in` as the weight does, B [N, r, out] `out`.
PARAM_RULES |= {
    f"{name}_lora_{part}": (None, rule[1], None) if part == "a" else (None, None, rule[2])
    for name, rule in PARAM_RULES.items()
    if len(rule) == 3
    for part in "ab"
}
# An 8-bit weight's scales (comppo_jax.models.quantize.SCALE) split as its output channels: the vocabulary of
# the embedding table and of the head, the last axis of a layer's matrix.
PARAM_RULES |= {
    f"{name}_scale": (rule[1 if name == "lm_head" else 0],) if len(rule) == 2 else (None, rule[2])
    for name, rule in list(PARAM_RULES.items())
    if "_lora_" not in name
}


def initialize_distributed(mesh_config) -> None:
    """Multi-host start-up (`config.mesh.distributed`); TPU pods find their peers themselves. On the CPU
    backend (gloo collectives) a collective waits `mesh.collective_timeout_s` for its peers, then fails,
    however the processes were started: a hung peer ends the run instead of holding it for XLA's
    default 30 minutes. Called before anything starts a backend, which reads XLA_FLAGS once."""
    if not mesh_config.distributed:
        return
    if os.environ.get("JAX_PLATFORMS") == "cpu":  # TPU and GPU collectives do not go through gloo
        os.environ["XLA_FLAGS"] = with_collective_timeout(
            os.environ.get("XLA_FLAGS", ""), mesh_config.get("collective_timeout_s", COLLECTIVE_TIMEOUT_S)
        )
    kwargs = {}
    if mesh_config.coordinator_address:
        kwargs = dict(
            coordinator_address=mesh_config.coordinator_address,
            num_processes=mesh_config.num_processes,
            process_id=mesh_config.process_id,
        )
    jax.distributed.initialize(**kwargs)


COLLECTIVE_TIMEOUT_S = 300
_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


def with_collective_timeout(xla_flags: str, seconds: int) -> str:
    """`xla_flags` with XLA:CPU's collective timeout set to `seconds`, unless it already sets one."""
    if _COLLECTIVE_TIMEOUT_FLAG in xla_flags:
        return xla_flags
    return f"{xla_flags} {_COLLECTIVE_TIMEOUT_FLAG}={int(seconds)}".strip()


def make_mesh(mesh_config, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh from `config.mesh`; one axis may be -1 (all remaining devices)."""
    devices = jax.devices() if devices is None else devices
    sizes = [int(mesh_config[axis]) for axis in AXES]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"config.mesh (data, fsdp, tensor) = {tuple(sizes)}: sizes must be positive, at most one -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"config.mesh {dict(zip(AXES, sizes))}: {len(devices)} devices are not a multiple of {known}"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"config.mesh {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} devices, found {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(sizes), AXES)


def run_meshes(mesh_config) -> tuple[Mesh, list | None]:
    """(the training mesh, the rollout stage's own devices or None): with mesh.rollout_devices = r
    the last r devices of every process roll out (`split_devices`) and `mesh_config` lays out the
    others."""
    if not mesh_config.get("rollout_devices", 0):
        return make_mesh(mesh_config), None
    train_devices, rollout_devices = split_devices(mesh_config.rollout_devices)
    return make_mesh(mesh_config, train_devices), rollout_devices


def split_devices(rollout_devices: int, devices=None) -> tuple[list, list]:
    """(training devices, rollout devices) of a run with its own rollout devices
    (mesh.rollout_devices): the last `rollout_devices` local devices of every process roll out,
    the others train; both lists in process order, so a batch's rows fall on the same process in
    either."""
    devices = jax.devices() if devices is None else devices
    processes = sorted({d.process_index for d in devices})
    local = {p: sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in processes}
    counts = {len(ds) for ds in local.values()}
    if len(counts) != 1 or not 0 < rollout_devices < min(counts):
        raise ValueError(
            f"config.mesh.rollout_devices={rollout_devices} must leave every process devices for both stages "
            f"(devices per process: {sorted(counts)})"
        )
    return (
        [d for p in processes for d in local[p][:-rollout_devices]],
        [d for p in processes for d in local[p][-rollout_devices:]],
    )


def move(tree: Any, shardings: Any) -> Any:
    """`tree` placed with `shardings` on another set of devices, device to device. In one process
    that is `jax.device_put`; across processes (where JAX's runtime here moves arrays only between
    shardings of the same devices) each process copies, from its own shards, the block each of its
    target devices holds: that block must lie in one of its source shards (a batch whose rows stay
    on their process, weights laid out alike on both device sets)."""
    if jax.process_count() == 1:
        return jax.tree.map(jax.device_put, tree, shardings)
    return jax.tree.map(_move_array, tree, shardings)


def _bounds(index: tuple, shape) -> list[tuple[int, int]]:
    return [block.indices(size)[:2] for block, size in zip(index, shape)]


def _move_array(x: jax.Array, target: NamedSharding) -> jax.Array:
    """`x` with sharding `target`, each target block stitched from this process's source blocks."""
    local = {}  # this process's distinct source blocks (replicas hold the same one)
    for shard in x.addressable_shards:
        local.setdefault(tuple(_bounds(shard.index, x.shape)), shard.data)
    pieces = []
    for device, index in target.addressable_devices_indices_map(x.shape).items():
        block = _bounds(index, x.shape)
        parts = []
        for bounds, data in local.items():
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(block, bounds)]
            if all(lo < hi for lo, hi in overlap) or not block:
                parts.append((overlap, bounds, data))
        volume = lambda region: int(np.prod([hi - lo for lo, hi in region]))
        if sum(volume(region) for region, _, _ in parts) != volume(block):
            raise ValueError(
                f"an array {x.shape} sharded {x.sharding.spec} holds on process {jax.process_index()} only part of the "
                f"block {index} that {device} needs under {target.spec}"
            )
        if len(parts) == 1 and parts[0][0] == parts[0][1] == block:
            pieces.append(jax.device_put(parts[0][2], device))
            continue
        with _on(device):  # slicing and placing are programs on one device, outside any context mesh's devices
            out = jnp.zeros([hi - lo for lo, hi in block], x.dtype, device=device)
        for region, bounds, data in parts:
            with _on(next(iter(data.devices()))):
                piece = data[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(region, bounds))]
            with _on(device):
                out = out.at[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(region, block))].set(
                    jax.device_put(piece, device)
                )
        pieces.append(out)
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


def _on(device):
    """`device`'s own one-device mesh as the context mesh (a program on it runs whatever mesh encloses it)."""
    return jax.set_mesh(Mesh(np.asarray([device]).reshape((1,) * len(AXES)), AXES))


def decode_mesh(mesh: Mesh, tensor: int) -> Mesh:
    """The rollout's decode layout on `mesh`'s devices: tensor-parallel groups of `tensor`
    consecutive devices (in the training mesh's order, whose last axis is `tensor`), replicated
    over the rest: (data = devices / tensor, fsdp = 1, tensor). Under PARAM_RULES a weight is then
    split `tensor` ways and whole within its group, so decoding gathers no weights."""
    devices = mesh.devices.reshape(-1)
    if tensor < 1 or devices.size % tensor:
        raise ValueError(f"rollout.mesh.tensor={tensor} must divide the {devices.size} devices")
    return Mesh(devices.reshape(devices.size // tensor, 1, tensor), AXES)


def batch_size_multiple(mesh: Mesh) -> int:
    """Batches (rollouts and minibatches) must be a multiple of this."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def _rule_for(path) -> tuple | None:
    for entry in reversed(path):
        if isinstance(entry, jax.tree_util.DictKey) and entry.key in PARAM_RULES:
            return PARAM_RULES[entry.key]
    return None


def leaf_spec(mesh: Mesh, path, shape) -> P:
    """The PartitionSpec of one weight (or optimizer moment) from PARAM_RULES."""
    rule = _rule_for(path)
    if rule is None or len(rule) != len(shape):
        return P()
    axes = []
    for axis, size in zip(rule, shape):
        if axis is not None and size % mesh.shape[axis]:
            logging.warning(
                "%s: dim %d not divisible by mesh axis %s=%d; replicated",
                jax.tree_util.keystr(path),
                size,
                axis,
                mesh.shape[axis],
            )
            axis = None
        axes.append(axis)
    return P(*axes)


def tree_shardings(mesh: Mesh, tree: Any) -> Any:
    """NamedShardings for a params or optimizer-state pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, leaf_spec(mesh, path, np.shape(x))), tree
    )


def abstract_sharded(mesh: Mesh, make) -> Any:
    """The shapes and dtypes of `make()` (not computed), with this file's shardings: a restore target."""
    tree = jax.eval_shape(make)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, tree_shardings(mesh, tree)
    )


def per_shard(fn, in_specs, out_specs):
    """`fn` under `jax.shard_map` over the context mesh (`jax.set_mesh`, `use_abstract_mesh`), or
    `fn` itself when there is none.

    Pallas (Mosaic) kernels cannot be partitioned by XLA: under a mesh they must see per-device
    blocks. The train loop, the evaluation and launch/plan.py trace inside their mesh's context.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def constrain(tree: Any, specs: Any) -> Any:
    """`with_sharding_constraint` under the context mesh; the tree itself without one."""
    if jax.sharding.get_abstract_mesh().empty:
        return tree
    return jax.lax.with_sharding_constraint(tree, specs)


def context_platform() -> str:
    """The platform being compiled for: the context mesh's devices' (a TPU plan traced on a CPU
    host says "tpu"), else JAX's default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def context_batch_shards() -> int:
    """How many ways the context mesh splits the batch (data x fsdp); 1 without a mesh."""
    shape = jax.sharding.get_abstract_mesh().shape
    return int(np.prod([shape.get(axis, 1) for axis in BATCH]))


def heads_axis(*head_counts: int) -> str | None:
    """`tensor` when the context mesh's tensor axis divides every head count, else None (replicated)."""
    tensor = jax.sharding.get_abstract_mesh().shape.get("tensor", 1)
    return "tensor" if all(count % tensor == 0 for count in head_counts) else None


def kv_head_repeat(num_heads: int, num_kv_heads: int) -> int:
    """How many copies of each kv head a head-split KV cache keeps: tensor / num_kv_heads where the
    context mesh's tensor axis is a larger multiple of the kv head count and divides the query
    heads (16 devices, 8 kv heads: each device keeps the one kv head its query heads read, instead
    of every device holding all of them), else 1."""
    tensor = jax.sharding.get_abstract_mesh().shape.get("tensor", 1)
    if tensor > num_kv_heads and tensor % num_kv_heads == 0 and num_heads % tensor == 0:
        return tensor // num_kv_heads
    return 1


def decode_group_sizes(num_heads: int, num_kv_heads: int, devices: int) -> list[int]:
    """The tensor-parallel group sizes G a decode layout can take on `devices`: dividing the devices
    and the query heads, and dividing the kv heads or a multiple of them (each chip then keeps the
    kv head its queries read, `kv_head_repeat`)."""
    return [
        g
        for g in range(1, devices + 1)
        if devices % g == 0 and num_heads % g == 0 and (num_kv_heads % g == 0 or g % num_kv_heads == 0)
    ]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Splits the leading (batch) dim over (data, fsdp); the other dims are replicated."""
    return NamedSharding(mesh, P(BATCH))


def features_spec(tensor: int, hidden_size: int) -> P:
    """The critic's features [L', B, L, D]: rows over (data, fsdp) and, where D divides, D over
    `tensor`. A TAC run keeps them for the whole rollout batch through the update; split, each
    chip holds 1/tensor of them (the critic's projections contract D: a small all-reduce)."""
    return P(None, BATCH, None, "tensor") if tensor > 1 and hidden_size % tensor == 0 else P(None, BATCH)


def features_sharding(mesh: Mesh, hidden_size: int) -> NamedSharding:
    return NamedSharding(mesh, features_spec(mesh.shape["tensor"], hidden_size))


def constrain_features(hidden_states):
    """`features_spec` under the context mesh (the scoring pass's output); unchanged without one."""
    tensor = jax.sharding.get_abstract_mesh().shape.get("tensor", 1)
    return constrain(hidden_states, features_spec(tensor, hidden_states.shape[-1]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def to_memory(tree: Any, kind: str) -> Any:
    """`tree`'s arrays moved to memory `kind` of their own devices ("pinned_host": host memory the
    accelerator reads directly; "device": HBM), sharded as before (None leaves stay None)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)


def put(tree: Any, shardings: Any) -> Any:
    """Places a pytree with matching shardings (None leaves stay None). A leaf that every process holds
    whole (a host array, or an array on this process's devices) and that goes onto several processes'
    devices is placed as `from_host` places it."""
    return jax.tree.map(_put, tree, shardings)


def _put(x, target: jax.sharding.Sharding):
    if target.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, target)
    # Not jax.device_put: from a one-device array onto processes with one device each (one process per
    # GPU) it builds an array whose shards cannot be listed, so Orbax's save fails ("An argument array
    # had 2 shard(s)").
    return from_host(x, target)


def from_host(tree: Any, shardings: Any) -> Any:
    """Host arrays, the same on every process, placed with `shardings` (a pytree, or one sharding for
    every leaf): each process puts its own devices' blocks. (`jax.device_put` onto several processes'
    devices first compares each array across them: a cross-process program each.)"""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]), tree, shardings)


def to_host(x) -> np.ndarray:
    """A (possibly multi-host sharded) array as one NumPy array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def any_process(flag: bool) -> bool:
    """`flag` or-ed over all processes (a collective: every process must call it at the same point)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def min_over_processes(value: int) -> int:
    """`value`'s minimum over all processes (a collective, as `any_process`)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


def split_over_processes(fn, items: list) -> list[int]:
    """`fn(items)` (a list of ints, one per item) computed with each process taking every
    process_count()-th item, then gathered, so all processes return the same list. Every process
    must call it with the same `items`."""
    count, index = jax.process_count(), jax.process_index()
    if count == 1 or not items:  # the same `items` everywhere: every process takes this branch together
        return list(fn(items))
    width = -(-len(items) // count)
    mine = np.full(width, -1, np.int32)
    mine[: len(items[index::count])] = fn(items[index::count])
    gathered = np.asarray(multihost_utils.process_allgather(mine))  # [count, width]
    return [int(gathered[i % count, i // count]) for i in range(len(items))]
