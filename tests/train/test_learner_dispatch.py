"""The learner's minibatch loop dispatches one program per update step and nothing else: no eager
gather per Minibatch field, each of which is, on a pod, a cross-process program (two processes
hung in them back to back over gloo: docs/reliability.md). A whole training step runs its
collectives in our jitted programs only, none in an eager operation on a sharded array."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import HANG_S, HELPERS_PATH, REPO, fake_devices_env

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
    from comppo_jax.rollout.experience import Sampled
    from comppo_jax.train.methods import init_critic
    from comppo_jax.train.rollout_stage import Experience
    from comppo_jax.train.specs import resolve
    from comppo_jax.train.update import adamw, jit_update_steps, minibatch_shardings
    from conftest import small_train_config
    from update_inputs import CONFIG, update_inputs

    def dispatched_by_one_update(offload: bool) -> list[str]:
        cfg = small_train_config(
            tempfile.mkdtemp(), train__minibatch_size=4, train__offload_idle=offload, critic__fused_layers=2,
            critic__top_k=4,
        )
        mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2), jax.devices())
        spec = resolve(cfg, CONFIG)
        credit = spec.learner.credit
        actor, _, _, _, _, _, _, batch = update_inputs(batch=8)
        actor_tx, critic_tx = adamw(cfg.train.actor_lr), adamw(cfg.train.critic_lr)
        critic = init_critic(credit, CONFIG, jax.random.PRNGKey(1))
        state = dict(actor=actor, actor_opt=actor_tx.init(actor), critic=critic, critic_opt=critic_tx.init(critic))
        state = sharding.put(state, sharding.tree_shardings(mesh, state))
        steps = jit_update_steps(
            mesh, state, model_config=CONFIG, actor_tx=actor_tx, critic_tx=critic_tx,
            critic_module=credit.critic_module, critic_kind=credit.recipe.critic,
        )
        generation = Generation(
            batch.tokens, batch.attention_mask, batch.prompt_lengths, batch.response_tokens, batch.response_mask,
            jnp.zeros(batch.response_mask.shape),
        )
        host_mask = np.asarray(batch.response_mask)
        rewards = np.asarray([1.0, 0.0] * 4)
        reward_tokens = np.zeros(host_mask.shape, np.float32)
        reward_tokens[np.arange(8), host_mask.sum(1) - 1] = rewards
        host_lengths = np.asarray(batch.attention_mask).sum(1).astype(np.int32)
        sampled = Sampled(generation, [], [], rewards, [], {}, host_mask, reward_tokens, host_lengths)
        with jax.set_mesh(mesh):
            options = spec.rollout.experience.scoring.options()
            rollout = jax.jit(lambda actor: score_rollout(actor, actor, CONFIG, generation, **options))(state["actor"])
            assert rollout.routing is not None
            learner = Learner(
                spec.learner, CONFIG, steps, minibatch_shardings(mesh, True, CONFIG.hidden_size), Offload.of(offload),
                {"controller": controller.initial_state()}, lambda what: None,
            )
            step = spec.steps.warmup + 1  # the critic's and the actor's epochs
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


def recorded_on_8_devices(script: str) -> dict:
    """What `script` records (its last stdout line, JSON), run in a subprocess with 8 fake CPU devices."""
    env = fake_devices_env(8, PYTHONPATH=os.pathsep.join([HERE, HELPERS_PATH]))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow  # a subprocess compiling a whole update on 8 devices: about 40 s
def test_the_minibatch_loop_dispatches_only_the_update_steps():
    for kind, dispatched in recorded_on_8_devices(SCRIPT).items():
        steps = [i for i, name in enumerate(dispatched) if name in UPDATE_STEPS]
        # 2 epochs (the controller's first phase) x 2 minibatches of 4 rows, a critic and an actor step each.
        assert len(steps) == 8, f"{kind}: {' '.join(dispatched)}"
        # The critic's epochs, then (their features freed) the actor's: between the steps of each, no other program.
        assert steps[3] - steps[0] == 3 and steps[7] - steps[4] == 3, f"{kind}: {' '.join(dispatched)}"


# A training step of CompPO (the critic's epochs, then the actor's; and with gate_refresh=epoch, interleaved with
# the gate's refresh) on a 2x2x2 mesh of 8 CPU devices, dynamic sampling on (the reward filter drops groups of equal
# rewards: the step refills), every program dispatched from the start of its rollout to the end of its checkpoint
# recorded by name, with whether its compiled HLO holds a collective: on one process's 8 devices a sharded array's
# collectives show where, on a pod, they run across processes. A jitted function keeps its name; an eager operation
# is a program named after its primitive or jax.numpy helper (gather, scatter-add, concatenate, _pad, _where, ...).
STEP_SCRIPT = textwrap.dedent(
    """
    import json, re, sys, tempfile
    from jax._src import pjit
    from jax._src.interpreters import pxla

    COLLECTIVE = re.compile(r"\\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\\(")
    programs, dispatched = {}, []
    pjit._get_fastpath_data = lambda *args, **kwargs: None
    execute = pxla.ExecuteReplicated.__call__

    def recorded(self, *args):
        if id(self) not in programs:  # each program's HLO read once (it is kept alive here)
            text = "\\n".join(module.to_string() for module in self.xla_executable.hlo_modules())
            programs[id(self)] = (self, bool(COLLECTIVE.search(text)))
        dispatched.append([self.name, programs[id(self)][1]])
        return execute(self, *args)

    pxla.ExecuteReplicated.__call__ = recorded

    from comppo_jax.train import learner, loop, recorder, staleness
    from conftest import small_train_config

    def marked(cls, name, mark):
        method = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            dispatched.append([f"start {mark}", False])
            out = method(self, *args, **kwargs)
            dispatched.append([f"end {mark}", False])
            return out

        setattr(cls, name, wrapper)

    marked(staleness.RolloutQueue, "take", "rollout")  # a step begins with its batch
    marked(learner.Learner, "update", "update")
    marked(recorder.Recorder, "checkpoint", "checkpoint")  # and ends with its checkpoint
    runs = {}
    for kind, settings in (("comppo", {}), ("gate_refresh", {"gate_refresh": "epoch"})):
        del dispatched[:]
        run = tempfile.mkdtemp()
        loop.train(
            small_train_config(
                run, steps=1, mesh__data=2, mesh__fsdp=2, mesh__tensor=2, train__minibatch_size=4,
                rollout__dynamic_sampling=True, rollout__dynamic_sampling_filter="reward", rollout__max_refills=1,
                train__eval_every=0, warm_start__steps=0, train__critic_warmup_steps=0, **settings,
            )
        )
        refills = [json.loads(line)["dynamic_sampling/refills"] for line in open(f"{run}/metrics.jsonl")]
        runs[kind] = {"dispatched": list(dispatched), "refills": refills}
    print(json.dumps(runs))
    """
)

# Our programs that hold collectives on a step's path, each a jitted function named here.
STEP_PROGRAMS = {
    "jit(decode_weights)",  # the sampler's weights in the decode layout (decode_layout)
    "jit(generate)",  # each generation round (rollout.sampler)
    "jit(_gather_rows)",  # dynamic sampling's kept groups (rollout.experience.take_groups)
    "jit(score_rollout)",  # the behaviour and reference scoring (rollout.scoring)
    "jit(<lambda>)",  # the checkpoint's leaf digests (checkpoint.state_digests), read back at once
}
# The learner's programs: nothing else runs in Learner.update.
LEARNER_PROGRAMS = {
    "jit(guarded_credit)",  # the credit, clipped, with its finite flags (read back at once)
    "jit(refreshed_gate)",  # gate_refresh=epoch: the current actor's gate
    "jit(refreshed_credit)",  # and the credit it gives (its gate change read back at once)
    "jit(step_on_rows)",  # the update steps (update.on_rows)
    "jit(_emptied_features)",  # the critic's features dropped before the actor's epochs
}
# What each run's update dispatched at least: the paths it covers.
EXPECTED_IN_UPDATE = {
    "comppo": {"jit(guarded_credit)", "jit(step_on_rows)", "jit(_emptied_features)"},
    "gate_refresh": {"jit(guarded_credit)", "jit(step_on_rows)", "jit(refreshed_gate)", "jit(refreshed_credit)"},
}


@pytest.mark.slow  # a subprocess compiling a whole training step on 8 devices: about 45 s
def test_a_training_step_runs_collectives_only_in_our_jitted_programs():
    for kind, run in recorded_on_8_devices(STEP_SCRIPT).items():
        assert max(run["refills"]) >= 1, kind  # a refill round, and take_groups, on a step's path
        with_collectives, in_update, inside, updating = [], [], False, False
        for name, collective in run["dispatched"]:
            inside = (inside or name == "start rollout") and name != "end checkpoint"
            updating = (updating or name == "start update") and name != "end update"
            if inside and collective:
                with_collectives.append(name)
            if updating and not name.startswith(("start ", "end ")):
                in_update.append(name)
        eager = sorted(set(with_collectives) - STEP_PROGRAMS - LEARNER_PROGRAMS)
        assert not eager, f"{kind}: collectives outside our jitted programs: {eager} in {' '.join(with_collectives)}"
        assert set(in_update) <= LEARNER_PROGRAMS, f"{kind}: {' '.join(in_update)}"
        assert "jit(_gather_rows)" in with_collectives, kind
        assert EXPECTED_IN_UPDATE[kind] <= set(in_update), f"{kind}: {' '.join(in_update)}"
