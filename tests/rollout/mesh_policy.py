"""The tiny policy that the 8-device payloads (decode_layouts.py, conversations_on_processes.py) sample:
their `--config.mesh` flags, and the policy sharded on that mesh, in one process with 8 fake CPU devices
or in each process of a launch/local_cluster.py run (2 x 4). A payload imports it as a sibling module
(`python tests/rollout/<payload>.py` puts this folder first on sys.path)."""

import os
import sys

import jax
import ml_collections
from ml_collections import config_flags

# tests/ for the tiny policy, after the repository root: tests/pallas_kernels must not stand for pallas_kernels.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[1:1] = [os.path.dirname(_TESTS), _TESTS]
from tiny_model import tiny_config  # noqa: E402

from comppo_jax import sharding  # noqa: E402
from comppo_jax.models import ModelConfig, init_params  # noqa: E402

_CONFIG = config_flags.DEFINE_config_dict(
    "config",
    ml_collections.ConfigDict(
        {
            "mesh": {
                "data": 1,
                "fsdp": 4,
                "tensor": 2,
                "distributed": False,
                "coordinator_address": "",
                "num_processes": 1,
                "process_id": 0,
                "collective_timeout_s": 300,
            }
        }
    ),
)


def sharded_policy() -> tuple[ModelConfig, jax.sharding.Mesh, dict]:
    """Joins the processes (`--config.mesh`), then the policy's config, the mesh and its sharded params."""
    sharding.initialize_distributed(_CONFIG.value.mesh)
    assert jax.device_count() == 8, jax.device_count()
    config = tiny_config(eos_token_ids=(6, 7), dtype="float32")
    mesh = sharding.make_mesh(_CONFIG.value.mesh)
    params = init_params(config, jax.random.PRNGKey(0), init_std=0.3)
    return config, mesh, sharding.put(params, sharding.tree_shardings(mesh, params))
