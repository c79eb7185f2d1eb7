"""A launch/local_cluster.py payload that shows why XLA:CPU over gloo hangs: one program, an
all-reduce over every device, run `--calls` times back to back (each call takes the last one's
output). With one device per process it finishes; with several, a call's collective waits for
peers that never join it, until the launcher's collective timeout ends the run. `--block` waits for
each call before dispatching the next, and it finishes."""

import time

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec
from joined_mesh import joined_mesh

from comppo_jax import cli

_CALLS = flags.DEFINE_integer("calls", 300, "How many calls of the all-reduce program.")
_BLOCK = flags.DEFINE_bool("block", False, "Wait for each call before dispatching the next.")


def main(argv):
    del argv
    mesh = joined_mesh()
    spec = PartitionSpec("d")
    step = jax.jit(jax.shard_map(lambda x: x + 1e-3 * jax.lax.psum(x, "d"), mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones((jax.device_count(), 256)), NamedSharding(mesh, spec))
    start = time.time()
    for _ in range(_CALLS.value):
        x = step(x)
        if _BLOCK.value:
            x.block_until_ready()
    x.block_until_ready()
    print(
        f"{_CALLS.value} calls on {jax.local_device_count()} devices per process: {time.time() - start:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    cli.run(main)
