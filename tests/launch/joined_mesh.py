"""What the launch/local_cluster.py payloads here share: the `--config.mesh.*` flags the launcher
passes each process, and one mesh axis over every process's devices."""

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh
from ml_collections import config_flags

from comppo_jax import sharding

_CONFIG = config_flags.DEFINE_config_dict(
    "config",
    ml_collections.ConfigDict(
        {
            "mesh": {
                "distributed": False,
                "coordinator_address": "",
                "num_processes": 1,
                "process_id": 0,
                "collective_timeout_s": 300,
            }
        }
    ),
)


def joined_mesh() -> Mesh:
    """Joins this process to the others (the launcher's flags; alone without them) and returns a mesh
    whose one axis, "d", spans every process's devices."""
    sharding.initialize_distributed(_CONFIG.value.mesh)
    return Mesh(np.array(jax.devices()), ("d",))
