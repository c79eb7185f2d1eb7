"""The update steps: fp32 master weights under bf16 compute, and the critic warm-up's frozen actor."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import nested_jaxprs
from update_inputs import CONFIG, HYPER, update_inputs

from comppo_jax.credit import gspo_loss, ppo_clip_loss
from comppo_jax.train.methods import ActorLoss
from comppo_jax.train.update import actor_step, cast_params, surrogate


def test_fp32_master_weights_train_through_a_bf16_forward():
    actor, actor_opt, actor_tx, *_, batch = update_inputs()
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16")
    step = functools.partial(actor_step, config=bf16, tx=actor_tx, temperature=1.0)
    jaxpr = jax.make_jaxpr(step)(actor, actor_opt, batch, HYPER["actor"]).jaxpr
    dots = [e for j in nested_jaxprs(jaxpr) for e in j.eqns if e.primitive.name == "dot_general"]
    assert any(all(v.aval.dtype == jnp.bfloat16 for v in e.invars) for e in dots)  # the forward computes in bf16 ...
    new_actor, new_opt, metrics = jax.jit(step)(actor, actor_opt, batch, HYPER["actor"])
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(new_actor))  # ... while the master weights stay fp32
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(new_opt.inner_state[0].mu))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), actor, new_actor)
    assert all(jax.tree.leaves(changed)) and bool(jnp.isfinite(metrics["grad_norm"]))


def test_cast_params_is_identity_in_the_same_dtype():
    actor, *_ = update_inputs(batch=2)
    same = cast_params(actor, jnp.float32)
    assert all(a.dtype == b.dtype and bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(actor), jax.tree.leaves(same)))
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(cast_params(actor, "bfloat16")))


def test_the_surrogate_follows_the_config():
    """PPO's upper clip is clip x clip_high_scale (DAPO's decoupled clip); GSPO gets its own clip range."""
    rng = np.random.default_rng(0)
    old = rng.normal(size=(3, 5)) * 0.3 - 1.0
    log_probs, old = jnp.asarray(old + rng.normal(size=(3, 5)) * 0.4, jnp.float32), jnp.asarray(old, jnp.float32)  # ratios past 1.2
    advantages = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    mask = jnp.asarray(np.arange(5)[None] < np.array([[5], [3], [1]]))
    decoupled = surrogate(ActorLoss(clip_high_scale=1.4), log_probs, old, advantages, mask, 0.2)
    expected = ppo_clip_loss(log_probs, old, advantages, mask, 0.2, 0.28)
    assert float(decoupled[0]) == float(expected[0]) != float(ppo_clip_loss(log_probs, old, advantages, mask, 0.2, 0.2)[0])
    sequence = ActorLoss(policy_loss="gspo_token", aggregation="seq-mean-token-mean", sequence_clip=(3e-4, 4e-4))
    expected = gspo_loss(log_probs, old, advantages, mask, 3e-4, 4e-4, token_level=True, aggregation="seq-mean-token-mean")
    assert float(surrogate(sequence, log_probs, old, advantages, mask, 0.2)[0]) == float(expected[0])
    dr_grpo = ActorLoss(aggregation="seq-mean-token-sum-norm", norm_length=16)
    expected = ppo_clip_loss(log_probs, old, advantages, mask, 0.2, 0.2, aggregation="seq-mean-token-sum-norm", norm_length=16)
    assert float(surrogate(dr_grpo, log_probs, old, advantages, mask, 0.2)[0]) == float(expected[0])
