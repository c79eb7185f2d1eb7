"""The update steps: fp32 master weights under bf16 compute, and the critic warm-up's frozen actor."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from conftest import nested_jaxprs
from update_inputs import CONFIG, HYPER, update_inputs

from comppo_jax.train.update import actor_step, cast_params


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
