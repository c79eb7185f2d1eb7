"""A launch/local_cluster.py payload: a policy made on this process's own device (as the warm start
leaves it) placed on the mesh of every process's devices (data parallel, weights replicated), saved as
a run's reference policy and restored, as a run's start and resume do. Prints whether the restored
policy has the made one's digests."""

import jax.numpy as jnp
from absl import flags
from joined_mesh import joined_mesh
from ml_collections import ConfigDict

from comppo_jax import cli, sharding
from comppo_jax.runs.checkpoint import RunCheckpoints, state_digests

_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "The run directory every process shares.", required=True)


def main(argv):
    del argv
    joined_mesh()
    mesh = sharding.make_mesh(ConfigDict(dict(data=-1, fsdp=1, tensor=1)))
    policy = {"embed": jnp.arange(32.0).reshape(8, 4), "norm": jnp.ones(4, jnp.bfloat16)}
    placed = sharding.put(policy, sharding.tree_shardings(mesh, policy))
    checkpoints = RunCheckpoints(_OUTPUT_DIR.value)
    checkpoints.save_reference(placed)
    restored = checkpoints.restore_reference(sharding.abstract_sharded(mesh, lambda: policy))
    print(f"restored the policy made: {state_digests(restored)[0] == state_digests(policy)[0]}", flush=True)
    checkpoints.close()


if __name__ == "__main__":
    cli.run(main)
