"""A launch/local_cluster.py payload: one all-reduce every process joins, then process 1 stalls
`--stall_s` seconds before the second one, as a hung or stopped host would."""

import time

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec
from joined_mesh import joined_mesh

from comppo_jax import cli

_STALL = flags.DEFINE_float("stall_s", 60.0, "How long process 1 stalls before the second all-reduce.")


def main(argv):
    del argv
    mesh = joined_mesh()
    total = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec())
    )
    x = jax.device_put(jnp.ones(jax.device_count()), NamedSharding(mesh, PartitionSpec("d")))
    for call in range(2):
        if call == 1 and jax.process_index() == 1:
            time.sleep(_STALL.value)
        print(f"all-reduce {call}: {float(total(x)[0])}", flush=True)


if __name__ == "__main__":
    cli.run(main)
