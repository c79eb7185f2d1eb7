"""The tiny policy that the 8-device payloads (decode_layouts.py, conversations_on_processes.py) sample:
their `--config.mesh` flags, and the policy sharded on that mesh, in one process with 8 fake CPU devices
or in each process of a launch/local_cluster.py run (2 x 4). A payload imports it as a sibling module
(`python tests/rollout/<payload>.py` puts this folder first on sys.path)."""

import jax
import ml_collections
from ml_collections import config_flags

from comppo_jax import sharding
from comppo_jax.models import ModelConfig, init_params

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
    config = ModelConfig(
        architecture="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        eos_token_ids=(6, 7),
        pad_token_id=0,
        dtype="float32",
    )
    mesh = sharding.make_mesh(_CONFIG.value.mesh)
    params = init_params(config, jax.random.PRNGKey(0), init_std=0.3)
    return config, mesh, sharding.put(params, sharding.tree_shardings(mesh, params))
