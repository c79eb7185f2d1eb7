"""The update steps: fp32 master weights under bf16 compute, the critic warm-up's frozen actor, and each
policy-loss variant's objective as a config switch makes it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import nested_jaxprs, small_train_config
from update_inputs import CONFIG, HYPER, update_inputs

from comppo_jax.credit import gspo_loss, ppo_clip_loss
from comppo_jax.credit.registry import ActorLoss, surrogate
from comppo_jax.train.specs import actor_loss_of
from comppo_jax.train.update import actor_step, cast_params


@functools.cache
def inputs():
    """update_inputs(), built once for the module: no step here donates them (jit(actor_step) donates nothing,
    the LoRA step only the adapters it adds)."""
    return update_inputs()


def test_fp32_master_weights_train_through_a_bf16_forward():
    actor, actor_opt, actor_tx, *_, batch = inputs()
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16")
    step = functools.partial(actor_step, config=bf16, tx=actor_tx)
    traced = jax.jit(step).trace(actor, actor_opt, batch, HYPER["actor"])  # one trace: inspected, then run
    dots = [e for j in nested_jaxprs(traced.jaxpr.jaxpr) for e in j.eqns if e.primitive.name == "dot_general"]
    assert any(all(v.aval.dtype == jnp.bfloat16 for v in e.invars) for e in dots)  # the forward computes in bf16 ...
    new_actor, new_opt, metrics = traced.lower().compile()(actor, actor_opt, batch, HYPER["actor"])
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(new_actor))  # ... while the master weights stay fp32
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(new_opt.inner_state[0].mu))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), actor, new_actor)
    assert all(jax.tree.leaves(changed)) and bool(jnp.isfinite(metrics["grad_norm"]))


def test_cast_params_is_identity_in_the_same_dtype():
    actor, *_ = inputs()
    same = cast_params(actor, jnp.float32)
    assert all(
        a.dtype == b.dtype and bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(actor), jax.tree.leaves(same))
    )
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(cast_params(actor, "bfloat16")))


def test_the_surrogate_follows_the_config():
    """PPO's upper clip is clip x clip_high_scale (DAPO's decoupled clip); GSPO gets its own clip range."""
    rng = np.random.default_rng(0)
    old = rng.normal(size=(3, 5)) * 0.3 - 1.0
    log_probs, old = (
        jnp.asarray(old + rng.normal(size=(3, 5)) * 0.4, jnp.float32),
        jnp.asarray(old, jnp.float32),
    )  # ratios past 1.2
    advantages = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    mask = jnp.asarray(np.arange(5)[None] < np.array([[5], [3], [1]]))
    decoupled = surrogate(ActorLoss(clip_high_scale=1.4), log_probs, old, advantages, mask, 0.2)
    expected = ppo_clip_loss(log_probs, old, advantages, mask, 0.2, 0.28)
    assert (
        float(decoupled[0]) == float(expected[0]) != float(ppo_clip_loss(log_probs, old, advantages, mask, 0.2, 0.2)[0])
    )
    sequence = ActorLoss(policy_loss="gspo_token", aggregation="seq-mean-token-mean", sequence_clip=(3e-4, 4e-4))
    expected = gspo_loss(
        log_probs, old, advantages, mask, 3e-4, 4e-4, token_level=True, aggregation="seq-mean-token-mean"
    )
    assert float(surrogate(sequence, log_probs, old, advantages, mask, 0.2)[0]) == float(expected[0])
    dr_grpo = ActorLoss(aggregation="seq-mean-token-sum-norm", norm_length=16)
    expected = ppo_clip_loss(
        log_probs, old, advantages, mask, 0.2, 0.2, aggregation="seq-mean-token-sum-norm", norm_length=16
    )
    assert float(surrogate(dr_grpo, log_probs, old, advantages, mask, 0.2)[0]) == float(expected[0])


# Three GRPO responses of lengths 5, 2, 3 with advantages 1, -0.5, 2, and per-token log ratios well
# inside every clip range (GSPO's sequence ratio stays within [1 - 3e-4, 1 + 4e-4]).
LENGTHS, ROW_ADVANTAGES, MAX_NEW_TOKENS = (5, 2, 3), (1.0, -0.5, 2.0), 16
LOG_RATIOS = [[1e-4, -2e-4, 0.5e-4, 1.5e-4, -1e-4], [-1e-4, 0.5e-4], [2e-4, -0.5e-4, 1e-4]]


def variant_inputs(log_ratios=LOG_RATIOS):
    mask = np.arange(5)[None] < np.asarray(LENGTHS)[:, None]
    log_ratio = np.zeros((3, 5))
    for row, values in enumerate(log_ratios):
        log_ratio[row, : len(values)] = values
    old = np.where(mask, -1.0 - 0.1 * np.arange(5)[None], 0.0)
    advantages = np.where(mask, np.asarray(ROW_ADVANTAGES)[:, None], 0.0)
    as_f32 = lambda x: jnp.asarray(x, jnp.float32)
    return as_f32(old + log_ratio), as_f32(old), as_f32(advantages), jnp.asarray(mask), log_ratio, mask


def loop_surrogate(clip=0.2, log_ratios=LOG_RATIOS, **switches):
    """The actor's surrogate as the train loop builds it: config -> actor_loss_of -> surrogate."""
    cfg = small_train_config("unused", method="grpo", rollout__max_new_tokens=MAX_NEW_TOKENS, **switches)
    logp, old, advantages, mask, _, _ = variant_inputs(log_ratios)
    return float(surrogate(actor_loss_of(cfg), logp, old, advantages, mask, clip)[0]), actor_loss_of(cfg)


def test_each_policy_loss_variant_trains_its_papers_objective_from_one_switch():
    _, _, _, _, log_ratio, mask = variant_inputs()
    ratio, adv = np.exp(log_ratio), np.asarray(ROW_ADVANTAGES)
    sequence_ratio = np.exp(np.asarray([np.mean(r) for r in LOG_RATIOS]))  # GSPO eq. 7: s_i = (pi / pi_old)^(1 / |y_i|)
    paper = {  # each paper's objective, negated (inside the clip ranges the min is the unclipped term)
        # GRPO / DAPO token-level loss: the mean over every token of the batch.
        (): -np.sum(np.where(mask, ratio * adv[:, None], 0)) / mask.sum(),
        # GSPO eq. 5: the mean over responses of s_i A_i.
        (("train__policy_loss", "gspo"),): -np.mean(sequence_ratio * adv),
        # GSPO-token eq. 13: the same value, each token's ratio carrying s_i.
        (("train__policy_loss", "gspo_token"),): -np.mean(sequence_ratio * adv),
        # Dr.GRPO (its code): the mean over responses of the token sums over the longest response.
        (("train__group_std_normalization", False),): -np.mean(np.sum(np.where(mask, ratio * adv[:, None], 0), 1))
        / MAX_NEW_TOKENS,
    }
    for switches, want in paper.items():
        got, loss = loop_surrogate(**dict(switches))
        assert got == pytest.approx(want, rel=1e-5), (switches, loss)
    # The example of the length bias: GSPO's sequence mean, not the token-weighted mean of the same tokens.
    gspo = loop_surrogate(train__policy_loss="gspo")[0]
    assert gspo == pytest.approx(-(1 - 0.5 + 2) / 3, abs=3e-4) and paper[()] == pytest.approx(
        -(5 - 1 + 6) / 10, abs=3e-4
    )
    # An explicit aggregation still wins over the variant's own.
    assert loop_surrogate(train__policy_loss="gspo", train__loss_aggregation="token-mean")[0] == pytest.approx(
        -np.sum(np.asarray(LENGTHS) * sequence_ratio * adv) / mask.sum(), rel=1e-5
    )
    assert loop_surrogate(train__group_std_normalization=False, train__loss_aggregation="seq-mean-token-sum-norm")[
        0
    ] == pytest.approx(
        3 * paper[(("train__group_std_normalization", False),)], rel=1e-5
    )  # verl's form: the sum over the 3 responses


def test_dapo_clips_higher_and_drops_the_kl_term_from_one_config():
    # One token of each row past 1 + 0.2 but under 1 + 0.28: PPO's symmetric clip stops it, DAPO's decoupled clip
    # does not.
    far = [[0.22] + row[1:] for row in LOG_RATIOS]
    _, _, _, _, log_ratio, mask = variant_inputs(far)
    adv = np.asarray(ROW_ADVANTAGES)[:, None]
    objective = lambda high: (
        -np.sum(np.where(mask, np.minimum(np.exp(log_ratio) * adv, np.clip(np.exp(log_ratio), 0.8, high) * adv), 0))
    )
    ppo, ppo_loss = loop_surrogate(log_ratios=far)
    dapo, dapo_loss = loop_surrogate(log_ratios=far, train__clip_high_scale=1.4, train__kl_coef_grpo=0.0)
    assert (
        ppo == pytest.approx(objective(1.2) / 10, rel=1e-5)
        and dapo == pytest.approx(objective(1.28) / 10, rel=1e-5)
        and dapo < ppo
    )
    assert ppo_loss.kl_term and not dapo_loss.kl_term
    # verl's convention: the KL aggregated as the policy loss is.
    assert (
        loop_surrogate(train__policy_loss="gspo", train__kl_aggregation="policy")[1].kl_aggregation
        == "seq-mean-token-mean"
    )
    assert loop_surrogate(train__policy_loss="gspo")[1].kl_aggregation == "token-mean"


def test_a_lora_step_trains_only_the_adapters_and_leaves_the_base_arrays_in_place():
    from comppo_jax.models import lora
    from comppo_jax.train.update import apply_actor_step, jit_update_steps

    base, _, actor_tx, *_, batch = inputs()
    actor = lora.join(
        base, lora.init_adapters(CONFIG, lora.LoraConfig(rank=4, targets=("q", "v", "down")), jax.random.PRNGKey(1))
    )
    actor_opt = actor_tx.init(lora.trainable(actor))
    assert jax.tree.structure(actor_opt.inner_state[0].mu) == jax.tree.structure(
        lora.trainable(actor)
    )  # AdamW moments: adapters only
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    steps = jit_update_steps(mesh, dict(actor=actor, actor_opt=actor_opt), model_config=CONFIG, actor_tx=actor_tx)
    before = jax.tree.map(np.asarray, lora.trainable(actor)["layers"])  # the step donates the adapters
    with jax.set_mesh(mesh):
        new_actor, new_opt, metrics = apply_actor_step(steps, actor, actor_opt, batch, HYPER["actor"])
    assert bool(metrics["actor_finite"]) and float(metrics["grad_norm"]) > 0
    # The base is read, not donated: the same arrays, still alive (the reference policy of a LoRA run is them).
    assert all(
        a is b and not a.is_deleted() for a, b in zip(jax.tree.leaves(lora.base(new_actor)), jax.tree.leaves(base))
    )
    after = lora.trainable(new_actor)["layers"]
    changed = {name for name in before if np.any(before[name] != np.asarray(after[name]))}
    assert changed == {
        f"{w}_lora_b" for w in ("q_proj", "v_proj", "down_proj")
    }  # B = 0 at the start: A's gradient is zero
    assert jax.tree.structure(new_opt.inner_state[0].mu) == jax.tree.structure(lora.trainable(new_actor))
