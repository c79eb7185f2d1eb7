"""The sharded update steps: a 2x2x2 (data, fsdp, tensor) mesh on 8 CPU devices equals one device,
and the tiny train step compiles ahead of time for a TPU topology through libtpu."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HANG_S, HELPERS_PATH, fake_devices_env
from jax.sharding import PartitionSpec as P

from comppo_jax import sharding

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from comppo_jax import sharding
    from comppo_jax.critic import init_value_model
    from comppo_jax.train.update import apply_actor_step, jit_update_steps, minibatch_shardings
    from update_inputs import CONFIG, HYPER, update_inputs

    assert len(jax.devices()) == 8
    KIND = sys.argv[1]  # the critic: tac, or the full value model

    def one_step(mesh_sizes, devices):
        mesh = sharding.make_mesh(dict(zip(sharding.AXES, mesh_sizes)), devices)
        actor, actor_opt, actor_tx, module, critic, critic_opt, critic_tx, batch = update_inputs()
        if KIND == "full":
            critic = init_value_model(actor, jnp.float32, jax.random.PRNGKey(2))
            critic_opt = critic_tx.init(critic)
        steps = jit_update_steps(mesh, dict(actor=actor, actor_opt=actor_opt, critic=critic, critic_opt=critic_opt),
                                 model_config=CONFIG, actor_tx=actor_tx, critic_tx=critic_tx,
                                 critic_module=module, critic_kind=KIND)
        state = (actor, actor_opt, critic, critic_opt)
        actor, actor_opt, critic, critic_opt = sharding.put(state, sharding.tree_shardings(mesh, state))
        batch = sharding.put(batch, minibatch_shardings(mesh, with_routing=True, hidden_size=CONFIG.hidden_size))
        values = steps.values(critic, batch)
        actor, actor_opt, actor_metrics = apply_actor_step(steps, actor, actor_opt, batch, HYPER["actor"])
        critic, critic_opt, critic_metrics = steps.critic(critic, critic_opt, batch, HYPER["critic"])
        # twice: a full critic's first step moves only its zero-initialised head
        critic, critic_opt, critic_metrics = steps.critic(critic, critic_opt, batch, HYPER["critic"])
        return (values, actor, actor_opt, critic, critic_opt, actor_metrics, critic_metrics), actor, critic, batch

    single, _, _, _ = one_step((1, 1, 1), jax.devices()[:1])
    sharded, actor, critic, batch = one_step((2, 2, 2), jax.devices())
    if KIND == "full":  # the value model's trunk is sharded as the policy's weights
        trunk_q = critic["trunk"]["layers"]["q_proj"].sharding
        assert trunk_q.spec == P(None, "fsdp", "tensor"), trunk_q
    assert actor["layers"]["q_proj"].sharding.spec == P(None, "fsdp", "tensor"), actor["layers"]["q_proj"].sharding
    assert actor["embed"].sharding.spec == P("tensor", "fsdp")
    assert len(actor["layers"]["q_proj"].addressable_shards) == 8
    assert batch.tokens.sharding.spec == P(("data", "fsdp"))
    assert batch.hidden_states.sharding.spec == P(None, ("data", "fsdp"), None, "tensor")
    paths = jax.tree_util.tree_flatten_with_path(jax.device_get(single))[0]
    # atol: 1% of the learning rate (1e-3). A full critic's trunk takes its first real step on the second
    # update, where AdamW moves a weight whose gradient is near its eps (1e-8) by a fraction of the learning
    # rate that rounding changes (8 devices sum in another order).
    for (path, a), b in zip(paths, jax.tree.leaves(jax.device_get(sharded))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    print("sharded == single device:", len(paths), "leaves")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["tac", "full"])
def test_update_step_on_a_2x2x2_mesh_equals_one_device(critic):
    env = fake_devices_env(8, PYTHONPATH=os.pathsep.join([HERE, HELPERS_PATH]))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, critic], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sharded == single device" in result.stdout


def test_make_mesh_sizes_and_errors():
    devices = jax.devices()[:1]
    mesh = sharding.make_mesh(dict(data=-1, fsdp=1, tensor=1), devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match="needs 4 devices, found 1"):
        sharding.make_mesh(dict(data=1, fsdp=4, tensor=1), devices)
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.make_mesh(dict(data=-1, fsdp=-1, tensor=1), devices)


def test_rules_shard_weights_and_their_adam_moments_alike_and_replicate_the_rest():
    mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    tree = {
        "mu": {
            "layers": {"q_proj": np.zeros((2, 32, 64)), "attn_norm": np.zeros((2, 32))},
            "embed": np.zeros((64, 32)),
        },
        "count": np.zeros(()),
        "layers": {"down_proj": np.zeros((2, 96, 31))},
    }
    specs = jax.tree_util.tree_map_with_path(lambda path, x: sharding.leaf_spec(mesh, path, x.shape), tree)
    assert specs["mu"]["layers"]["q_proj"] == P(None, "fsdp", "tensor")
    assert specs["mu"]["layers"]["attn_norm"] == P() and specs["count"] == P()
    assert specs["mu"]["embed"] == P("tensor", "fsdp")
    assert specs["layers"]["down_proj"] == P(None, "tensor", None)  # 31 is not divisible by fsdp=2: replicated


def test_to_memory_moves_arrays_between_host_and_device_memory_keeping_their_values():
    tree = {"moments": jnp.arange(8.0), "none": None}
    parked = sharding.to_memory(tree, "pinned_host")
    assert parked["moments"].sharding.memory_kind == "pinned_host" and parked["none"] is None
    back = sharding.to_memory(parked, "device")
    assert back["moments"].sharding.memory_kind == "device"
    np.testing.assert_array_equal(back["moments"], tree["moments"])


def test_the_critics_features_split_their_width_over_tensor_where_it_divides():
    rows = ("data", "fsdp")
    assert sharding.features_spec(4, 2560) == P(
        None, rows, None, "tensor"
    )  # Qwen3-4B on a tensor-4 mesh: a quarter per chip
    assert sharding.features_spec(4, 30) == P(None, rows)  # does not divide: replicated over tensor
    assert sharding.features_spec(1, 2560) == P(None, rows)
    assert sharding.constrain_features(jnp.ones((2, 4, 3, 8))).shape == (2, 4, 3, 8)  # no mesh: unchanged


def test_the_collective_timeout_joins_xla_flags_unless_they_set_one():
    assert sharding.with_collective_timeout("", 20) == "--xla_cpu_collective_timeout_seconds=20"
    flags = "--xla_force_host_platform_device_count=4 --xla_cpu_collective_timeout_seconds=7"
    assert sharding.with_collective_timeout(flags, 20) == flags  # the launcher's or the user's own wins
