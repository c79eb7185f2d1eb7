"""The rollout correction through the learner's path: a config's train.rollout_correction, resolved into
the learner's spec, weighs the advantages of its credit program by the sampler -> scorer importance
weights, logs the mismatch, and the actor loss and gradient are the padded hand computation's; the
weights compose with train.proximal=recompute, the refreshed gate's credit, every policy loss and
sequence packing."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import packed_batches
import pytest
from conftest import small_train_config
from update_inputs import CONFIG, update_inputs

from comppo_jax.models import init_params
from comppo_jax.train.learner import Learner, Offload, Signals, refreshed_credit
from comppo_jax.train.methods import init_critic
from comppo_jax.train.specs import resolve
from comppo_jax.train.update import actor_loss, critic_values, policy_token_stats

# Sampler -> scorer ratios r, cycled over the valid tokens: two over the cap 2, one under the lower cap 1/2.
DESIGNED_RATIOS = (0.25, 1.0, 3.0, 1.5, 2.5, 0.8, 1.2)
CAP = 2.0
CLIP = 5.0  # the advantages' clip


@functools.cache
def learner_of(**overrides):
    """(the Learner of small_train_config(**overrides) on update_inputs' tiny model, its critic: None for GRPO).
    Its credit program runs the critic's values as an update step's would (`critic_values`). One per config
    for the module: its jitted programs compile once (nothing here writes to its output directory)."""
    cfg = small_train_config("unused", critic__fused_layers=2, critic__top_k=4, **overrides)
    spec = resolve(cfg, CONFIG).learner
    credit = spec.credit
    critic = init_critic(credit, CONFIG, jax.random.PRNGKey(3))
    values = functools.partial(
        critic_values, critic_module=credit.critic_module, kind=credit.recipe.critic, model_config=CONFIG
    )
    steps = SimpleNamespace(values=None if critic is None else values)
    return Learner(spec, CONFIG, steps, None, Offload.of(False), {"controller": None}, lambda what: None), critic


@functools.cache
def designed_batch():
    """(the actor, a batch of 4 responses, the sampler's log-probs: the batch's old (scorer's) log-probs
    minus log DESIGNED_RATIOS, NaN on padding, the ratios [B, T] (1 on padding), the mask, the signals)."""
    actor, *_, batch = update_inputs(batch=4, response=6)
    mask = np.asarray(batch.response_mask)
    ratios = np.ones(mask.shape)
    ratios[mask] = np.resize(DESIGNED_RATIOS, mask.sum())
    sampler = np.where(mask, np.asarray(batch.old_log_probs, np.float64) - np.log(ratios), np.nan)
    rewards = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
    reward_tokens = np.zeros(mask.shape, np.float32)
    reward_tokens[np.arange(4), mask.sum(1) - 1] = rewards
    signals = Signals(jnp.where(mask, 0.5, 0.0), rewards, reward_tokens, jnp.asarray(sampler, jnp.float32))
    return actor, batch, ratios, mask, signals


def hand_weights(rule: str) -> np.ndarray:
    """c = min(r, 2) (tis) or r, 0 outside [1/2, 2] (mis), per token."""
    ratios, mask = designed_batch()[2:4]
    capped = np.minimum(ratios, CAP) if rule == "tis" else np.where((ratios > CAP) | (ratios < 1 / CAP), 0.0, ratios)
    return np.where(mask, capped, 0.0)


@functools.cache
def loss_gradient(spec):
    """The gradient of the actor loss `spec` (clip 0.2, no KL), jitted: one program for every call here (eagerly,
    each op would compile on its own)."""
    return jax.jit(jax.grad(lambda params, b: actor_loss(params, CONFIG, b, 0.2, 0.0, spec)[0]))


def credit_of(learner, critic):
    """The learner's credit program on the designed batch: (fields, kappa, advantages, weights, metrics, finite)."""
    _, batch, _, _, signals = designed_batch()
    return learner.credit(critic, batch, signals, jax.random.PRNGKey(2), CLIP)


@pytest.mark.parametrize("rule", ["tis", "mis"])
def test_the_learner_weighs_the_clipped_advantages_by_the_sampler_to_scorer_weights_and_logs_them(rule):
    """train.rollout_correction=tis / mis -> the resolved LearnerSpec -> the Learner's credit program: the
    advantages are those of rollout_correction=none times c, and the actor loss on them is the padded hand
    computation (a masked token still counted in the token-mean), its gradient the one of the uncorrected
    update on advantages pre-multiplied by c, on packed rows too."""
    actor, batch, ratios, mask, _ = designed_batch()
    learner, _ = learner_of(method="grpo", train__rollout_correction=rule)
    plain, _ = learner_of(method="grpo")
    _, _, advantages, weights, metrics, finite = credit_of(learner, None)
    _, _, plain_advantages, no_weights, plain_metrics, _ = credit_of(plain, None)
    c = hand_weights(rule)
    assert no_weights is None and all(bool(ok) for ok in finite.values())
    np.testing.assert_allclose(weights, c, rtol=1e-5)
    np.testing.assert_allclose(advantages, np.asarray(plain_advantages) * c, rtol=1e-5, atol=1e-7)
    # The mismatch is logged whatever the correction; the weights' metrics only with one.
    r = ratios[mask]
    assert float(metrics["mismatch/kl"]) == pytest.approx(np.mean(r - 1 - np.log(r)), rel=1e-4)
    assert float(metrics["mismatch/abs_log_ratio_max"]) == pytest.approx(np.log(4.0), rel=1e-5)
    assert float(metrics["mismatch/ratio_outside_half_to_two"]) == pytest.approx(np.mean((r < 0.5) | (r > 2)))
    assert float(metrics["rollout_correction/weight_mean"]) == pytest.approx(r.mean(), rel=1e-5)
    assert float(metrics["rollout_correction/weight_max"]) == pytest.approx(3.0, rel=1e-5)
    dropped, lower = ("masked", 1 / CAP) if rule == "mis" else ("truncated", 0.0)
    assert float(metrics[f"rollout_correction/{dropped}_fraction"]) == pytest.approx(np.mean((r > CAP) | (r < lower)))
    assert set(plain_metrics) == {name for name in metrics if name.startswith("mismatch/")}
    # The actor loss of a policy moved off the behaviour one, by hand, token by token.
    other = init_params(CONFIG, jax.random.PRNGKey(1), init_std=0.2)
    current = jax.tree.map(lambda a, b: 0.8 * a + 0.2 * b, actor, other)
    log_probs = policy_token_stats(
        current, CONFIG, batch.tokens, batch.attention_mask, batch.prompt_lengths, batch.response_tokens, 1.0
    )[0]
    ratio = np.exp(np.asarray(log_probs, np.float64) - np.asarray(batch.old_log_probs, np.float64))
    a = np.asarray(plain_advantages, np.float64)
    per_token = -c * np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
    loss = lambda params, b: actor_loss(params, CONFIG, b, 0.2, 0.0, learner.spec.actor_loss)[0]
    corrected = batch._replace(advantages=advantages)
    assert float(loss(current, corrected)) == pytest.approx(per_token[mask].sum() / mask.sum(), rel=1e-4, abs=1e-6)
    grad = loss_gradient(learner.spec.actor_loss)
    gradient = grad(current, corrected)
    premultiplied = grad(current, batch._replace(advantages=plain_advantages * c))
    packed = grad(current, corrected._replace(packing=packed_batches.packing_of(batch.attention_mask)))
    for got in (premultiplied, packed):
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(gradient)):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_the_lower_cap_from_the_config_lets_a_small_ratio_stay():
    """train.rollout_correction_lower_cap=0.2: r = 0.25 stays (under the default 1/2 it leaves the loss)."""
    learner, _ = learner_of(method="grpo", train__rollout_correction="mis", train__rollout_correction_lower_cap=0.2)
    ratios, mask = designed_batch()[2:4]
    weights = np.asarray(credit_of(learner, None)[3])
    small = mask & np.isclose(ratios, 0.25)
    assert small.any()
    np.testing.assert_allclose(weights[small], 0.25, rtol=1e-5)
    np.testing.assert_allclose(hand_weights("mis")[small], 0.0)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_a_response_level_correction_weighs_each_response_by_its_ratios_product_or_geometric_mean(level):
    learner, _ = learner_of(
        method="grpo",
        train__rollout_correction="tis",
        train__rollout_correction_level=level,
    )
    plain, _ = learner_of(method="grpo")
    _, _, advantages, weights, _, _ = credit_of(learner, None)
    ratios, mask = designed_batch()[2:4]
    log_rho = np.where(mask, np.log(ratios), 0.0).sum(1)
    rho = np.exp(log_rho if level == "sequence" else log_rho / mask.sum(1))
    c = np.where(mask, np.minimum(rho, CAP)[:, None], 0.0)
    np.testing.assert_allclose(weights, c, rtol=1e-5)
    np.testing.assert_allclose(advantages, np.asarray(credit_of(plain, None)[2]) * c, rtol=1e-5, atol=1e-7)


def test_a_non_finite_sampler_log_prob_is_named_by_the_guard_only_with_a_correction():
    actor, batch, _, mask, signals = designed_batch()
    poisoned = signals._replace(sampler_log_probs=signals.sampler_log_probs.at[0, 0].set(jnp.nan))
    for correction, flagged in (("tis", True), ("none", False)):
        learner, _ = learner_of(method="grpo", train__rollout_correction=correction)
        *_, metrics, finite = learner.credit(None, batch, poisoned, jax.random.PRNGKey(2), CLIP)
        assert np.isnan(float(metrics["mismatch/kl"]))
        assert ("rollout correction weights" in finite and not bool(finite["rollout correction weights"])) == flagged
        assert bool(finite["advantages"]) != flagged


@pytest.mark.parametrize("method", ["comppo", "ppo"])
def test_the_weights_multiply_every_estimators_advantages(method):
    """CompPO's Comp-GAE (TAC critic) and PPO's GAE (the standard head), as GRPO's above."""
    learner, critic = learner_of(method=method, train__rollout_correction="mis")
    plain, _ = learner_of(method=method)
    advantages = credit_of(learner, critic)[2]
    plain_advantages = credit_of(plain, critic)[2]
    assert np.abs(np.asarray(plain_advantages)).sum() > 0
    np.testing.assert_allclose(advantages, np.asarray(plain_advantages) * hand_weights("mis"), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo_token"])
def test_the_weights_compose_with_the_sequence_ratio_losses(policy_loss):
    """GSPO's losses read the weighted advantages as PPO's does: the gradient is the uncorrected loss's on
    advantages pre-multiplied by c."""
    actor, batch, *_ = designed_batch()
    overrides = dict(method="grpo", train__policy_loss=policy_loss)
    learner, _ = learner_of(train__rollout_correction="tis", **overrides)
    plain, _ = learner_of(**overrides)
    advantages, plain_advantages = credit_of(learner, None)[2], credit_of(plain, None)[2]
    loss = lambda b: actor_loss(actor, CONFIG, b, 0.2, 0.0, learner.spec.actor_loss)[0]
    got = loss(batch._replace(advantages=advantages))
    want = loss(batch._replace(advantages=plain_advantages * hand_weights("tis")))
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    assert float(got) != pytest.approx(float(loss(batch._replace(advantages=plain_advantages))), rel=1e-3)


def test_the_weights_compose_with_the_decoupled_objective_and_the_refreshed_credit():
    """train.proximal=recompute: the advantages carry both weights, behaviour -> proximal times sampler ->
    scorer; gate_refresh=epoch's credit multiplies its fresh advantages by each of them."""
    actor, batch, _, mask, signals = designed_batch()
    learner, _ = learner_of(method="grpo", train__proximal="recompute", train__rollout_correction="tis")
    plain, _ = learner_of(method="grpo")
    fields, kappa, advantages, weights, _, _ = credit_of(learner, None)
    proximal, capped, metrics, _ = learner.proximal_inputs(actor, batch._replace(advantages=advantages))
    assert float(metrics["importance_weight/max"]) != pytest.approx(1.0)  # the behaviour log-probs are not the actor's
    both = np.asarray(capped) * hand_weights("tis")
    np.testing.assert_allclose(proximal["advantages"], np.asarray(credit_of(plain, None)[2]) * both, rtol=1e-5)
    comppo, _ = learner_of(method="comppo")
    credit = comppo.spec.credit
    refreshed = functools.partial(refreshed_credit, credit, batch, signals, kappa, jax.random.PRNGKey(2), CLIP)
    alone = refreshed()[0]["advantages"]
    np.testing.assert_allclose(
        refreshed((weights, capped))[0]["advantages"], np.asarray(alone) * both, rtol=1e-5, atol=1e-7
    )


@pytest.mark.slow  # a whole (tiny) run: about 40 s
def test_a_run_logs_the_mismatch_and_the_correction_to_metrics_jsonl(tmp_path):
    from comppo_jax.train import loop

    loop.train(
        small_train_config(
            tmp_path, steps=1, method="grpo", train__rollout_correction="mis", train__eval_every=0, warm_start__steps=0
        )
    )
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for row in rows:
        # Sampler and scorer agree on CPU in float32: the ratios are 1 up to rounding.
        assert row["mismatch/kl"] == pytest.approx(0.0, abs=1e-5)
        assert row["mismatch/abs_log_ratio_max"] < 1e-3 and row["mismatch/ratio_outside_half_to_two"] == 0.0
        assert row["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["rollout_correction/masked_fraction"] == 0.0 and "nonfinite" not in row
