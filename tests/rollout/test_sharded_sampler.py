"""`generate` on sharded params and a mesh equals the unsharded run (8 fake CPU devices, one jit).

Under the run's mesh (data 2 x fsdp 2 x tensor 2) the engine splits the prompts over 4 shards,
each with its own slots and page pool, and kv heads over `tensor` (repeated where `tensor` exceeds
them); the Pallas kernel path runs per shard (`sharding.per_shard`). Row r's tokens depend only on (rng, r), so they
must match exactly.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import HANG_S, HELPERS_PATH, fake_devices_env

SCRIPT = textwrap.dedent(
    """
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from comppo_jax import sharding
    from tiny_model import tiny_config

    from comppo_jax.models import init_params
    from comppo_jax.rollout import engine, generate

    assert len(jax.devices()) == 8
    config = tiny_config(eos_token_ids=(6, 7, 8, 9))
    params = init_params(config, jax.random.PRNGKey(0), init_std=0.3)
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(10, 64, (6, 7)), jnp.int32)  # 6 prompts: the last of 4 shards is padded
    mask = jnp.asarray(rng.random((6, 7)) > 0.3).at[:, 3].set(True)

    def same(a, b):
        for field in a._fields:
            np.testing.assert_allclose(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), atol=1e-5,
                                       err_msg=field)

    # The run's mesh: params by the sharding rules, the engine split over data x fsdp.
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = sharding.put(params, sharding.tree_shardings(mesh, params))
    alone_runs = {}  # (backend, slots) -> the unsharded run
    for backend, slots in [("xla", None), ("xla", 5), ("gpu_interpret", 3)]:
        kwargs = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, num_samples=2, page_size=4, decode_slots=slots,
                      paged_attention=backend)
        alone = alone_runs[backend, slots] = generate(params, config, prompts, mask, jax.random.PRNGKey(1), **kwargs)
        with jax.set_mesh(mesh):
            split = generate(sharded, config, prompts, mask, jax.random.PRNGKey(1), **kwargs)
            lowered = generate.lower(sharded, config, prompts, mask, jax.random.PRNGKey(1), **kwargs)
            compiled = lowered.compile().as_text()
        same(alone, split)
        lengths = np.asarray(alone.response_mask).sum(axis=1)
        assert lengths.min() < 10 <= lengths.max(), lengths  # EOS ended some rows early
        # No device gathers another shard's pages: every all-gather is smaller than one shard's
        # smallest pool (decode_slots=3: 1 slot per shard, 1 + 2 x 2 + 4 pages of 4 tokens per layer).
        pool_elements = 2 * (1 + 2 * 2 + 4) * 4 * (2 * 2) * 8  # layers x pages x page_size x (k, v) kv heads x hd
        gathered = [int(np.prod([int(d) for d in re.findall(r"\\d+", shape)] or [1]))
                    for shape in re.findall(r"= [a-z0-9]+\\[([0-9,]*)\\][^ ]* all-gather\\(", compiled)]
        assert max(gathered) < pool_elements, (max(gathered), pool_elements)
        print(backend, slots, "ok")

    # tensor 4 > 2 kv heads: the pool keeps each kv head twice, so each device holds one head of
    # its shard's pages (a replicated pool would hold both: twice the bytes, plus its copies).
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    kwargs = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, num_samples=2, page_size=4, decode_slots=None,
                  paged_attention="xla")
    with jax.set_mesh(mesh):
        assert engine.pool_kv_heads(config) == 4
        placed = sharding.put(params, sharding.tree_shardings(mesh, params))
        split = generate(placed, config, prompts, mask, jax.random.PRNGKey(1), **kwargs)
        long = dict(kwargs, max_new_tokens=4096)  # the pool dominates the program's temporaries
        lowered = generate.lower(params, config, prompts, mask, jax.random.PRNGKey(1), **long)
        temp = lowered.compile().memory_analysis().temp_size_in_bytes
        layout = engine.make_layout(6, 7, num_samples=2, max_new_tokens=4096, page_size=4, decode_slots=None,
                                    shards=2)
        device_pool = engine.pool_bytes(config, layout) / 4
    same(alone_runs["xla", None], split)
    assert temp < 2 * device_pool, (temp, device_pool)
    print("repeated kv heads ok")

    # Megatron-style sharded params with no context mesh: one shard, XLA partitions the matmuls.
    model_mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    last_axis = lambda x: P(*([None] * (x.ndim - 1)), "model") if x.ndim >= 2 else P()
    megatron = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(model_mesh, last_axis(x))), params)
    kwargs = dict(max_new_tokens=6, temperature=1.0, top_p=0.9, num_samples=2)
    same(generate(params, config, prompts, mask, jax.random.PRNGKey(1), **kwargs),
         generate(megatron, config, prompts, mask, jax.random.PRNGKey(1), **kwargs))
    print("sharded ok")
    """
)


@pytest.mark.slow
def test_generate_on_a_mesh_matches_unsharded():
    env = fake_devices_env(8, PYTHONPATH=HELPERS_PATH)
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "repeated kv heads ok" in result.stdout and "sharded ok" in result.stdout
