"""The full-copy critic (critic.kind=full): a fresh copy of the policy's trunk with verl's value head
(weight ~ N(0, 0.02), zero bias) and, as in tunix and verl, no clamp on its values; every weight
trained by the critic step, started from the policy by the train loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import small_train_config
from update_inputs import CONFIG, HYPER, update_inputs

from comppo_jax.critic import init_value_model, value_model_values
from comppo_jax.critic.value_model import TRUNK
from comppo_jax.models import init_params
from comppo_jax.sharding import make_mesh
from comppo_jax.train.methods import init_critic, initial_keys
from comppo_jax.train.specs import resolve
from comppo_jax.train.update import adamw, critic_values, jit_update_steps


def test_the_value_model_is_a_fresh_copy_of_the_policy_trunk_with_a_linear_head():
    actor = init_params(CONFIG, jax.random.PRNGKey(0))
    critic = init_value_model(actor, jnp.float32, jax.random.PRNGKey(2))
    assert set(critic["trunk"]) == set(TRUNK) and "lm_head" in actor  # no vocabulary projection
    for copied, original in zip(
        jax.tree.leaves(critic["trunk"]), jax.tree.leaves({name: actor[name] for name in TRUNK})
    ):
        np.testing.assert_array_equal(copied, original)
        assert copied.unsafe_buffer_pointer() != original.unsafe_buffer_pointer()  # donating one never frees the other
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, CONFIG.vocab_size)
    values = value_model_values(critic, CONFIG, tokens, jnp.ones(tokens.shape, bool))
    assert values.shape == tokens.shape and np.all(values)  # verl's random head: V != 0 before training


def assert_verls_head(head):
    """verl's score head, not a zero one: weight ~ N(0, 0.02), zero bias."""
    weight = np.asarray(head["weight"])
    assert weight.shape == (weight.size,) and weight.size >= 32
    assert abs(weight.std() - 0.02) < 0.005 and abs(weight.mean()) < 0.01, (weight.std(), weight.mean())
    assert float(head["bias"]) == 0.0


def test_the_loops_full_critic_has_verls_head_and_unclamped_values(tmp_path):
    """Built as the train loop builds it (`init_critic` with the run's critic key), read as the update
    step reads it (`critic_values`): values beyond [-1, 1] come back as the head computes them."""
    cfg = small_train_config(tmp_path, method="ppo", critic__kind="full")
    credit = resolve(cfg, CONFIG).learner.credit
    _, critic_rng, _ = initial_keys(cfg.seed)
    critic = init_critic(
        credit, CONFIG, critic_rng, policy=init_params(CONFIG, jax.random.PRNGKey(0)), master_dtype="float32"
    )
    assert_verls_head(critic["head"])
    minibatch = update_inputs()[-1]
    values = lambda bias: np.asarray(
        critic_values(
            {**critic, "head": {**critic["head"], "bias": jnp.float32(bias)}},
            minibatch,
            critic_module=None,
            kind="full",
            model_config=CONFIG,
        )
    )
    mask = np.asarray(minibatch.response_mask)
    centred = values(0.0)
    assert 0 < np.abs(centred[mask]).max() < 1  # w . h alone, small at init
    for bias in (3.0, -3.0):
        shifted = values(bias)
        assert np.all(np.abs(shifted[mask]) > 1.0)  # no clamp to [-1, 1]
        np.testing.assert_allclose(shifted[mask], centred[mask] + bias, rtol=1e-6, atol=1e-6)


def test_the_critic_step_trains_every_weight_of_the_value_model_and_leaves_the_actor_alone():
    actor, actor_opt, actor_tx, _, _, _, _, minibatch = update_inputs()
    critic, critic_tx = init_value_model(actor, jnp.float32, jax.random.PRNGKey(2)), adamw(1e-2)
    before = jax.tree.map(np.asarray, critic)
    mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    steps = jit_update_steps(
        mesh,
        dict(actor=actor, actor_opt=actor_opt, critic=critic, critic_opt=critic_tx.init(critic)),
        model_config=CONFIG,
        actor_tx=actor_tx,
        critic_tx=critic_tx,
        critic_kind="full",
    )
    hyper = {k: jnp.float32(v) for k, v in HYPER["critic"].items()}
    params, opt = critic, critic_tx.init(critic)
    losses = []
    for _ in range(3):
        params, opt, out = steps.critic(params, opt, minibatch, hyper)
        losses.append(float(out["value_loss"]))
    changed = jax.tree.map(lambda new, old: not np.array_equal(np.asarray(new), old), params, before)
    assert all(jax.tree.leaves(changed)), changed
    assert losses[-1] < losses[0]
    values = steps.values(params, minibatch)
    assert values.shape == minibatch.response_mask.shape and np.all(np.isfinite(values))
    assert not any(
        x.is_deleted() for x in jax.tree.leaves(actor)
    )  # the trunk was a copy: the donated critic freed nothing of the actor


def test_ppo_with_critic_kind_full_starts_its_critic_from_the_policy_and_scores_without_actor_features(tmp_path):
    from comppo_jax.models import model_config
    from comppo_jax.runs.checkpoint import RunCheckpoints
    from comppo_jax.train.loop import training_mesh
    from comppo_jax.train.start import starting_point

    cfg = small_train_config(
        tmp_path,
        method="ppo",
        critic__kind="full",
        warm_start__steps=0,
        train__master_dtype="float32",
        model__arch__dtype="bfloat16",
        rollout__old_log_probs="sampler",
    )
    mesh, _ = training_mesh(cfg)
    checkpoints = RunCheckpoints(cfg.output_dir)
    spec = resolve(cfg, model_config(cfg.model))
    start = starting_point(cfg, spec, mesh, None, checkpoints, [], show_progress=False)
    critic, reference = start.state["critic"], start.reference()
    assert spec.learner.credit.recipe.critic == "full" and spec.learner.credit.hidden_layers == ()
    assert_verls_head(critic["head"])
    for copied, policy in zip(
        jax.tree.leaves(critic["trunk"]), jax.tree.leaves({name: reference[name] for name in TRUNK})
    ):
        assert copied.dtype == jnp.float32  # trained in the master dtype, from the bf16 starting policy
        np.testing.assert_array_equal(copied, policy.astype(jnp.float32))
    assert jax.tree.structure(start.state["critic_opt"].inner_state[0].mu) == jax.tree.structure(critic)
    # With the sampler's log-probs nothing reads the behaviour policy's forward: no scoring pass of its own.
    assert spec.rollout.experience.scoring.options()["behaviour_pass"] is False
    checkpoints.close()
