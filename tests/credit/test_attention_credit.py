"""credit.estimator=attention_anchor (Li et al. 2025, section 5.2 (2), global-anchor credit) against NumPy hand
computations: the TopQ anchors, GRPO's advantage amplified on them, and the train loop's path from
configs/tiny.py through the specs, the scoring pass and the learner's credit program."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import packed_batches
import pytest
from attention_anchor_oracles import anchors, grpo, materialized_influence
from conftest import small_train_config
from tiny_model import tiny_config

from comppo_jax.credit.attention_credit import anchor_tokens
from comppo_jax.credit.registry import EstimatorSpec, Statistics, attention_anchor_credit, estimate
from comppo_jax.data.rewards import terminal_reward_tokens
from comppo_jax.models import init_params
from comppo_jax.rollout import score_rollout
from comppo_jax.rollout.experience import Sampled
from comppo_jax.train.learner import Learner, Offload, Signals, rollout_batch
from comppo_jax.train.specs import resolve
from comppo_jax.train.update import Minibatch

CONFIG = tiny_config()

# FAI of 3 responses of 8 slots; lengths 8, 5 and 2 (right padding after them).
INFLUENCE = np.array(
    [
        [0.10, 0.30, 0.20, 0.30, 0.05, 0.40, 0.90, 0.80],
        [0.70, 0.10, 0.20, 0.60, 0.50, 0.00, 0.00, 0.00],
        [0.90, 0.80, 0.00, 0.00, 0.00, 0.00, 0.00, 0.00],
    ],
    np.float32,
)
LENGTHS = np.array([8, 5, 2])
MASK = np.arange(8)[None] < LENGTHS[:, None]


def test_the_anchors_are_the_top_fraction_of_the_tokens_whose_influence_is_defined():
    """H_lo = 2: a token needs a response token 2 or more later. Row 0: tokens 0..5 are defined, ceil(0.4 * 6) = 3
    anchors: 5 (0.40), then 1 and 3 tie at 0.30 and both make it; 6 and 7 (0.9, 0.8) have no FAI. Row 1: tokens
    0..2, ceil(1.2) = 2: 0 and 2. Row 2: no token has two after it: none."""
    got = anchor_tokens(jnp.asarray(INFLUENCE), jnp.asarray(MASK), 0.4, 2)
    expected = np.zeros(MASK.shape, bool)
    expected[0, [1, 3, 5]] = True
    expected[1, [0, 2]] = True
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, anchors(INFLUENCE, LENGTHS, 0.4, 2))
    # A tie at the cut goes to the earlier token; ceil(0.7 * 10) is 7, however float32 rounds 0.7 * 10.
    ties = anchor_tokens(jnp.ones((1, 12)), jnp.ones((1, 12), bool), 0.7, 2)
    np.testing.assert_array_equal(ties[0], np.arange(12) < 7)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_the_estimator_amplifies_grpo_s_signed_advantage_on_the_anchors(normalize_std):
    """A~_t = (1 + (gamma_amp - 1) 1{t in T_glob}) A_t, A_t GRPO's group-relative advantage, both signs."""
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], np.float32)  # groups of 3: one right, two right
    influence = np.concatenate([INFLUENCE, INFLUENCE[::-1]])
    lengths = np.concatenate([LENGTHS, LENGTHS[::-1]])
    mask = np.arange(8)[None] < lengths[:, None]
    spec = EstimatorSpec(
        "attention_anchor",
        group=3,
        normalize_std=normalize_std,
        anchor_fraction=0.5,
        anchor_amplification=2.5,
        anchor_horizon=(1, 4),
    )
    zeros = jnp.zeros(mask.shape)
    args = (spec, rewards, zeros, jnp.zeros(mask.shape, jnp.int32), zeros, zeros, jnp.asarray(mask))
    advantages, returns = estimate(*args, Statistics(jnp.asarray(influence)))
    if normalize_std:
        group = grpo(rewards, 3)
    else:
        group = rewards - np.repeat(rewards.reshape(2, 3).mean(1), 3)
    gamma = 1.0 + 1.5 * anchors(influence, lengths, 0.5, 1)
    np.testing.assert_allclose(advantages, np.where(mask, group[:, None] * gamma, 0.0), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(returns, 0.0)
    assert (gamma > 1).any() and (group < 0).any()  # the negative advantages are amplified too
    with pytest.raises(ValueError, match="attention_anchor reads the scoring pass's future attention influence"):
        attention_anchor_credit(*args)


def test_the_train_loop_s_credit_is_the_hand_computation(tmp_path):
    """configs/tiny.py with method=grpo, credit.estimator=attention_anchor -> resolve's specs (the scoring pass
    now runs the behaviour forward, with the paper's FAI horizon) -> score_rollout on ragged, right-padded rows ->
    Signals.of -> the Learner's credit program: the advantages are GRPO's times gamma_t of the TopQ anchors of
    FAI on the final layer's materialized attention, by hand."""
    cfg = small_train_config(
        tmp_path,
        method="grpo",
        credit__estimator="attention_anchor",
        rollout__samples_per_prompt=4,
        rollout__old_log_probs="sampler",
    )
    spec = resolve(cfg, CONFIG)
    scoring = spec.rollout.experience.scoring
    assert scoring.behaviour_pass and scoring.influence_horizon == (10, 100)
    generation = packed_batches.long_tailed_generation(CONFIG.vocab_size, seed=2, mean_response=20.0)
    params = init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)
    rollout = score_rollout(params, None, CONFIG, generation, **scoring.options())  # the default (XLA) backend
    rewards = np.array([1, 0, 0, 1, 0, 0, 0, 1], np.float32)
    host_mask = np.asarray(generation.response_mask)
    sampled = Sampled(generation, [], [], rewards, [], {}, host_mask, terminal_reward_tokens(rewards, host_mask), None)
    learner = Learner(
        spec.learner, CONFIG, SimpleNamespace(values=None), None, Offload.of(False), {"controller": None}, print
    )
    batch = rollout_batch(sampled, rollout, Minibatch(*[None] * len(Minibatch._fields)))
    clip = 100.0
    advantages = learner.credit(None, batch, Signals.of(rollout, sampled), jax.random.PRNGKey(1), clip)[2]

    lengths = host_mask.sum(1)
    influence = materialized_influence(params, CONFIG, generation, lengths, (10, 100), host_mask.shape[1])
    np.testing.assert_allclose(rollout.influence, influence, rtol=1e-4, atol=1e-7)
    gamma = 1.0 + 0.5 * anchors(influence, lengths, 0.4, 10)
    expected = np.where(host_mask, grpo(rewards, 4)[:, None] * gamma, 0.0)
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-6)
    assert gamma.max() == 1.5 and (lengths > 10).sum() >= 4  # anchors in several responses


@pytest.mark.slow  # a whole (tiny) run
def test_a_run_with_the_attention_anchor_estimator_updates(tmp_path):
    import json

    from comppo_jax.train import loop

    loop.train(
        small_train_config(
            tmp_path,
            steps=1,
            method="grpo",
            credit__estimator="attention_anchor",
            rollout__old_log_probs="sampler",
            train__eval_every=0,
            warm_start__steps=0,
        )
    )
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows and all("nonfinite" not in row for row in rows)
    assert json.load(open(tmp_path / "config.json"))["credit"]["attention_anchor_horizon_hi"] == 100
