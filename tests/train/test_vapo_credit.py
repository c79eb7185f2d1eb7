"""credit.estimator=vapo through the learner's path: the config (configs/tiny.py with method=ppo) resolved into
its credit spec, the learner's credit program on a hand-made batch, and the critic warm-up (VAPO's value
pretraining: critic-only steps on the fixed initial policy's samples) regressing on the lambda_critic returns,
all against NumPy hand computations of Yue et al. 2025 (arXiv 2504.05118): the advantages from GAE with
lambda_policy = 1 - 1 / (alpha l) per response, whitened; the critic's targets from GAE with lambda_critic."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_train_config
from update_inputs import CONFIG

from comppo_jax import sharding
from comppo_jax.rollout.experience import Sampled
from comppo_jax.rollout.sampler import Generation
from comppo_jax.rollout.scoring import Rollout
from comppo_jax.train import controller
from comppo_jax.train.learner import Learner, Offload, Signals, credit_fields
from comppo_jax.train.rollout_stage import Experience
from comppo_jax.train.specs import credit_spec, resolve
from comppo_jax.train.update import Minibatch, minibatch_shardings
from comppo_jax.train.validation import validate_config

LENGTHS = np.array([2, 5, 8, 6])  # alpha = 0.25: alpha l = 0.5 (lambda clipped to 0), 1.25, 2, 1.5
ALPHA = 0.25
PROMPT, WIDTH = 3, 8


def vapo_config(tmp_path, critic_lam=1.0, **overrides):
    cfg = small_train_config(
        tmp_path,
        method="ppo",
        credit__estimator="vapo",
        credit__vapo_alpha=ALPHA,
        credit__vapo_critic_lam=critic_lam,
        **overrides,
    )
    validate_config(cfg)
    return cfg


@functools.cache
def designed():
    """(generation, rewards [B], reward tokens, values (garbage on padding), mask) of 4 right-padded responses."""
    mask = np.arange(WIDTH)[None] < LENGTHS[:, None]
    rows = len(LENGTHS)
    attention = np.concatenate([np.ones((rows, PROMPT), bool), mask], axis=1)
    tokens = np.where(attention, 5, 0).astype(np.int32)
    rewards = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
    reward_tokens = np.zeros(mask.shape, np.float32)
    reward_tokens[np.arange(rows), LENGTHS - 1] = rewards
    values = np.where(mask, np.random.default_rng(0).uniform(-1, 1, mask.shape), 99.0).astype(np.float32)
    generation = Generation(
        jnp.asarray(tokens),
        jnp.asarray(attention),
        jnp.full((rows,), PROMPT, jnp.int32),
        jnp.asarray(tokens[:, PROMPT:]),
        jnp.asarray(mask),
        jnp.zeros(mask.shape),
    )
    return generation, rewards, reward_tokens, values, mask


def hand_gae(lams):
    """Paper GAE at gamma = 1 with row b's lambda lams[b]: delta_t = r_t + V_{t+1} - V_t, A_t = delta_t +
    lam_b A_{t+1}, G_t = A_t + V_t, all 0 past the response (float64)."""
    _, _, reward_tokens, values, _ = designed()
    advantages, returns = np.zeros(values.shape), np.zeros(values.shape)
    for b, length in enumerate(LENGTHS):
        next_value = next_advantage = 0.0
        for t in reversed(range(length)):
            advantages[b, t] = reward_tokens[b, t] + next_value - values[b, t] + lams[b] * next_advantage
            returns[b, t] = advantages[b, t] + values[b, t]
            next_value, next_advantage = values[b, t], advantages[b, t]
    return advantages, returns


def hand_credit(critic_lam):
    """(whitened advantages of lambda_policy = max(0, 1 - 1 / (alpha l)), the critic's lambda_critic returns)."""
    mask = designed()[4]
    lam_policy = np.maximum(0.0, 1.0 - 1.0 / (ALPHA * LENGTHS))
    np.testing.assert_allclose(lam_policy, [0.0, 0.2, 0.5, 1 / 3])
    advantages = hand_gae(lam_policy)[0]
    valid = advantages[mask]
    whitened = np.where(mask, (advantages - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8), 0.0)
    return whitened, hand_gae(np.full(len(LENGTHS), critic_lam))[1]


def given_values(critic, batch):
    """The stub critic: its 'params' are the values V [B, T] themselves."""
    return critic


@pytest.mark.parametrize("critic_lam", [1.0, 0.8])
def test_credit_fields_give_length_adaptive_advantages_and_lambda_critic_returns(tmp_path, critic_lam):
    """config -> credit_spec -> the learner's credit_fields (jitted as the learner runs it) = the hand computation;
    train.lam (the auto estimator's GAE lambda) is not read."""
    generation, rewards, reward_tokens, values, mask = designed()
    credit = credit_spec(vapo_config(tmp_path, critic_lam), CONFIG)
    assert (credit.recipe.estimator, credit.recipe.critic, credit.estimator.vapo_alpha) == ("vapo", "standard", ALPHA)
    batch = Minibatch(*generation[:5], generation.log_probs, *[None] * 7)
    signals = Signals(None, rewards, reward_tokens, generation.log_probs)
    program = jax.jit(lambda v, b, s: credit_fields(credit, given_values, v, b, s, jax.random.PRNGKey(0)))
    fields, _ = program(jnp.asarray(values), batch, signals)
    want_advantages, want_returns = hand_credit(critic_lam)
    np.testing.assert_allclose(fields["advantages"], want_advantages, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fields["returns"], want_returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fields["old_values"], values)
    if critic_lam == 1.0:  # Monte-Carlo returns at gamma = 1: each response's reward on every token
        np.testing.assert_allclose(fields["returns"], np.where(mask, rewards[:, None], 0.0), atol=1e-6)
    plain = credit_spec(small_train_config(tmp_path / "auto", method="ppo"), CONFIG)
    plain_fields, _ = jax.jit(lambda v, b, s: credit_fields(plain, given_values, v, b, s, jax.random.PRNGKey(0)))(
        jnp.asarray(values), batch, signals
    )
    assert np.abs(np.asarray(plain_fields["advantages"]) - want_advantages).max() > 0.1  # PPO's GAE(0.95) differs


def test_the_critic_warm_up_regresses_on_the_lambda_critic_returns_and_the_actor_waits(tmp_path):
    """Learner.update in the critic warm-up (train.critic_warmup_steps=2, step 1): every critic minibatch step
    reads the lambda_critic = 1 Monte-Carlo returns as its targets and the actor is not updated; after the
    warm-up (step 3) the actor's steps read the length-adaptive advantages (clipped at 5: unchanged here)."""
    generation, rewards, reward_tokens, values, mask = designed()
    spec = resolve(vapo_config(tmp_path, 1.0, train__critic_warmup_steps=2), CONFIG).learner
    critic_targets, actor_advantages = [], []

    def critic_on_rows(critic, opt, batch, rows, hyper):
        critic_targets.append((np.asarray(rows), np.asarray(batch.returns)))
        return critic, opt, {}

    def actor_on_rows(trainable, opt, batch, rows, hyper, frozen):
        actor_advantages.append((np.asarray(rows), np.asarray(batch.advantages)))
        return trainable, opt, {}

    steps = SimpleNamespace(values=given_values, critic_on_rows=critic_on_rows, actor_on_rows=actor_on_rows)
    mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    learner = Learner(
        spec,
        CONFIG,
        steps,
        minibatch_shardings(mesh, False, CONFIG.hidden_size),
        Offload.of(False),
        {"controller": controller.initial_state()},
        lambda what: None,
    )
    host_lengths = (PROMPT + LENGTHS).astype(np.int32)
    sampled = Sampled(generation, [], [], rewards, [], {}, mask, reward_tokens, host_lengths)
    want_advantages, want_returns = hand_credit(1.0)
    for step in (1, 3):
        # The standard head's features, which the stub critic does not read (the learner frees them each step).
        features = jnp.zeros((1, len(LENGTHS), PROMPT + WIDTH, CONFIG.hidden_size))
        rollout = Rollout(*generation[:3], mask, generation.log_probs, None, None, None, None, features, None)
        experience = Experience(step, 0, sampled, rollout, 0.0, (0.0, 0.0))
        state = dict(actor={"w": jnp.zeros(2)}, actor_opt=None, critic=jnp.asarray(values), critic_opt=None)
        with jax.set_mesh(mesh):
            _, learned = learner.update(state, experience, step, jax.random.PRNGKey(0))
        assert learned.applied_actor == (step > 2) and not learned.nonfinite
    # 2 steps x 2 epochs x 2 minibatches of 2 rows for the critic; the actor's only after the warm-up.
    assert len(critic_targets) == 8 and len(actor_advantages) == 4
    for rows, returns in critic_targets:
        np.testing.assert_allclose(returns[rows], want_returns[rows], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(returns[rows], np.where(mask, rewards[:, None], 0.0)[rows], atol=1e-6)
    for rows, advantages in actor_advantages:
        np.testing.assert_allclose(advantages[rows], want_advantages[rows], rtol=1e-5, atol=1e-5)
