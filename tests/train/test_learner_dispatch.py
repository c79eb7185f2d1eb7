"""The learner's minibatch loop dispatches one program per update step and nothing else: no eager
gather per Minibatch field, each of which is, on a pod, a cross-process program (two processes
hung in them back to back over gloo: docs/reliability.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import HANG_S, REPO, fake_devices_env

HERE = os.path.dirname(os.path.abspath(__file__))

# One Learner.update of CompPO (TAC critic with routing: every Minibatch field) on a 2x2x2 mesh of
# 8 CPU devices, with the batch on the devices and with it on the host (train.offload_idle), every
# program it dispatches recorded by name. jit's C++ fast path runs a cached program without Python;
# turned off, every program, a jitted step or an eager operation (each primitive is a program of its
# own), runs through pxla.ExecuteReplicated.__call__.
SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from jax._src import pjit
    from jax._src.interpreters import pxla

    dispatched = []
    pjit._get_fastpath_data = lambda *args, **kwargs: None
    execute = pxla.ExecuteReplicated.__call__

    def recorded(self, *args):
        dispatched.append(self.name)
        return execute(self, *args)

    pxla.ExecuteReplicated.__call__ = recorded

    from comppo_jax import sharding
    from comppo_jax.rollout import score_rollout
    from comppo_jax.rollout.sampler import Generation
    from comppo_jax.train import controller
    from comppo_jax.train.learner import Learner, Offload
    from comppo_jax.train.methods import critic_warmup, init_critic, run_parts, scoring_options
    from comppo_jax.train.rollout_stage import Experience
    from comppo_jax.train.sampling import Sampled
    from comppo_jax.train.update import adamw, jit_update_steps, minibatch_shardings
    from conftest import small_train_config
    from update_inputs import CONFIG, update_inputs

    def dispatched_by_one_update(offload: bool) -> list[str]:
        cfg = small_train_config(
            tempfile.mkdtemp(), train__minibatch_size=4, train__offload_idle=offload, critic__fused_layers=2,
            critic__top_k=4,
        )
        mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2), jax.devices())
        parts = run_parts(cfg, CONFIG)
        actor, _, _, _, _, _, _, batch = update_inputs(batch=8)
        actor_tx, critic_tx = adamw(cfg.train.actor_lr), adamw(cfg.train.critic_lr)
        critic = init_critic(parts, CONFIG, jax.random.PRNGKey(1))
        state = dict(actor=actor, actor_opt=actor_tx.init(actor), critic=critic, critic_opt=critic_tx.init(critic))
        state = sharding.put(state, sharding.tree_shardings(mesh, state))
        steps = jit_update_steps(
            mesh, model_config=CONFIG, temperature=1.0, actor=state["actor"], actor_opt=state["actor_opt"],
            actor_tx=actor_tx, critic=state["critic"], critic_opt=state["critic_opt"], critic_tx=critic_tx,
            critic_module=parts.critic_module, critic_kind=parts.recipe.critic,
        )
        generation = Generation(
            batch.tokens, batch.attention_mask, batch.prompt_lengths, batch.response_tokens, batch.response_mask,
            jnp.zeros(batch.response_mask.shape),
        )
        host_mask = np.asarray(batch.response_mask)
        rewards = np.asarray([1.0, 0.0] * 4)
        reward_tokens = np.zeros(host_mask.shape, np.float32)
        reward_tokens[np.arange(8), host_mask.sum(1) - 1] = rewards
        sampled = Sampled(generation, [], [], rewards, [], {}, host_mask, reward_tokens)
        with jax.set_mesh(mesh):
            options = scoring_options(cfg, parts)
            rollout = jax.jit(lambda actor: score_rollout(actor, actor, CONFIG, generation, **options))(state["actor"])
            assert rollout.routing is not None
            learner = Learner(
                cfg, CONFIG, parts, steps, minibatch_shardings(mesh, True, CONFIG.hidden_size), Offload.of(offload),
                {"controller": controller.initial_state()}, lambda what: None,
            )
            step = critic_warmup(cfg, parts.recipe) + 1  # the critic's and the actor's epochs
            experience = Experience(step, step, sampled, rollout, 0.0, (0.0, 0.0))
            del dispatched[:]
            state, learned = learner.update(state, experience, step, jax.random.PRNGKey(2))
        assert learned.applied_actor and not learned.nonfinite, learned
        return list(dispatched)

    print(json.dumps({kind: dispatched_by_one_update(kind == "offload") for kind in ("device", "offload")}))
    """
)

# The update steps' programs (comppo_jax.train.update), on a whole batch's rows or on a minibatch.
UPDATE_STEPS = {"jit(step_on_rows)", "jit(actor_step)", "jit(critic_step)"}


def test_the_minibatch_loop_dispatches_only_the_update_steps():
    env = fake_devices_env(
        8, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for kind, dispatched in json.loads(result.stdout.splitlines()[-1]).items():
        steps = [i for i, name in enumerate(dispatched) if name in UPDATE_STEPS]
        # 2 epochs (the controller's first phase) x 2 minibatches of 4 rows, a critic and an actor step each.
        assert len(steps) == 8, f"{kind}: {' '.join(dispatched)}"
        # The critic's epochs, then (their features freed) the actor's: between the steps of each, no other program.
        assert steps[3] - steps[0] == 3 and steps[7] - steps[4] == 3, f"{kind}: {' '.join(dispatched)}"
