"""The sampler runs on params sharded over a device mesh (4 CPU devices, one jit, no host loop)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from comppo_jax.models import ModelConfig, init_params
    from comppo_jax.rollout import generate

    assert len(jax.devices()) == 4
    config = ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False, eos_token_ids=(), pad_token_id=0)
    params = init_params(config, jax.random.PRNGKey(0), init_std=0.3)
    mesh = Mesh(np.array(jax.devices()), ("model",))
    # Megatron-style: shard every matrix's output (or vocab) dimension over the mesh.
    def spec(path, x):
        return NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "model") if x.ndim >= 2 else P())
    sharded = jax.tree_util.tree_map_with_path(lambda p, x: jax.device_put(x, spec(p, x)), params)
    prompts = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]]); mask = jnp.ones((2, 4), bool)
    kwargs = dict(max_new_tokens=6, temperature=1.0, top_p=0.9, num_samples=2)
    a = generate(params, config, prompts, mask, jax.random.PRNGKey(1), **kwargs)
    b = generate(sharded, config, prompts, mask, jax.random.PRNGKey(1), **kwargs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5)
    print("sharded ok", sharded["layers"]["q_proj"].sharding.spec)
    """
)


def test_generate_with_sharded_params_matches_unsharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharded ok" in result.stdout
