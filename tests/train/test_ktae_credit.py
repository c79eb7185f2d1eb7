"""credit.estimator=ktae through the loop's path: configs/tiny.py with method=grpo, resolved by
comppo_jax.train.specs.credit_spec, run by the learner's credit program (comppo_jax.train.learner.credit_fields,
jitted as the learner runs it), equals a hand computation of KTAE (Sun et al. 2025, arXiv 2505.16826,
method section) on a hand-made batch of two groups."""

from __future__ import annotations

import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import expit
from scipy.stats import fisher_exact

from comppo_jax.models import load_config_file
from comppo_jax.models.loading import model_config
from comppo_jax.train.learner import Signals, credit_fields
from comppo_jax.train.specs import credit_spec
from comppo_jax.train.update import Minibatch

TINY = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.py"
EOS = 2  # configs/tiny.py's model.arch.eos_token_ids
PROMPT = 3
# Two groups of 4 (rollout.samples_per_prompt=4), right padded with 0; rows ending in EOS stopped, the
# others ran out of tokens. Group 0 mixes correct (1, and 0.7 after a length penalty) and incorrect (0,
# and the format penalty -0.5) rollouts; group 1's are all incorrect: GRPO's advantage alone.
RESPONSES = np.array(
    [
        [5, 6, 7, 6, EOS, 0],
        [5, 8, 8, 9, 9, 9],
        [6, 7, 5, EOS, 0, 0],
        [8, 5, EOS, 0, 0, 0],
        [5, 6, EOS, 0, 0, 0],
        [7, 7, 7, 7, 7, 7],
        [9, EOS, 0, 0, 0, 0],
        [5, 8, 6, 9, EOS, 0],
    ],
    np.int32,
)
MASK = RESPONSES != 0
REWARDS = np.array([1.0, 0.0, 0.7, -0.5, 0.0, 0.0, -0.5, 0.0], np.float32)


def entropy_bits(x, y):
    return -sum(p * math.log2(p) for p in (x / (x + y), y / (x + y)) if p > 0) if x + y else 0.0


def hand_ktae(rewards, tokens, mask, group, h1, h2, h3, scale, std):
    """A_ij = A_i^GRPO + 2 scale (sigmoid((h1 F + h2 IG) D / (h1 + h2)) - 1/2), the value 0 for EOS and in
    groups without both outcomes; F = exp(-2 p) (0 at p = 1) of scipy's two-sided Fisher p-value of the
    presence table [[a, b], [c, d]], IG in bits, D = asin sqrt(a / (a + c)) - asin sqrt(b / (b + d)) +
    h3 (TF_T / (TF_F + 1e-5) - TF_F / (TF_T + 1e-5)) with BM25 (k1 = 2, b = 0.5) on occurrence rates."""
    out = np.zeros(tokens.shape)
    for start in range(0, len(rewards), group):
        rows = list(range(start, start + group))
        r = rewards[rows].astype(np.float64)
        spread = r.std(ddof=1) + 1e-6 if std else 1.0  # Dr.GRPO without the std
        base = (r - r.mean()) / spread if np.ptp(r) else np.zeros(group)  # a tied group: 0
        seqs = [list(tokens[i][mask[i]]) for i in rows]
        right = [s for s, x in zip(seqs, r) if x > 0]
        wrong = [s for s, x in zip(seqs, r) if x <= 0]
        for i, seq, adv in zip(rows, seqs, base):
            for t, token in enumerate(seq):
                out[i, t] = adv
                if not right or not wrong or token == EOS:
                    continue
                a, b = sum(token in s for s in right), sum(token in s for s in wrong)
                c, d = len(right) - a, len(wrong) - b
                p = fisher_exact([[a, b], [c, d]]).pvalue
                f = 0.0 if math.isclose(p, 1.0) else math.exp(-2 * p)
                ig = (
                    entropy_bits(len(right), len(wrong))
                    - ((a + b) * entropy_bits(a, b) + (c + d) * entropy_bits(c, d)) / group
                )
                lengths = sum(map(len, right)), sum(map(len, wrong))
                average = sum(lengths) / 2
                tf = [sum(s.count(token) for s in side) / n for side, n in zip((right, wrong), lengths)]
                bm25 = [x * 3.0 / (x + 2.0 * (0.5 + 0.5 * n / average)) for x, n in zip(tf, lengths)]
                d_score = math.asin(math.sqrt(a / (a + c))) - math.asin(math.sqrt(b / (b + d)))
                d_score += h3 * (bm25[0] / (bm25[1] + 1e-5) - bm25[1] / (bm25[0] + 1e-5))
                out[i, t] += 2 * scale * (expit((h1 * f + h2 * ig) * d_score / (h1 + h2)) - 0.5)
    return out


def ktae_config(**credit):
    config = load_config_file(TINY)
    config.method = "grpo"
    config.credit.estimator = "ktae"
    config.rollout.samples_per_prompt = 4
    config.credit.update(credit)
    return config


def learner_advantages(config):
    """The advantages and returns of the learner's credit program (jitted) on the hand-made batch."""
    credit = credit_spec(config, model_config(config.model))
    batch, length = RESPONSES.shape
    tokens = np.concatenate([np.full((batch, PROMPT), 4, np.int32), RESPONSES], axis=1)
    zeros = jnp.zeros((batch, length))
    minibatch = Minibatch(
        tokens=jnp.asarray(tokens),
        attention_mask=jnp.concatenate([jnp.ones((batch, PROMPT), bool), jnp.asarray(MASK)], axis=1),
        prompt_lengths=jnp.full((batch,), PROMPT, jnp.int32),
        response_tokens=jnp.asarray(RESPONSES),
        response_mask=jnp.asarray(MASK),
        old_log_probs=zeros,
        **dict.fromkeys(("ref_log_probs", "advantages", "returns", "old_values", "kappa_sequence"), None),
        hidden_states=None,  # GRPO has no critic to read them
        routing=None,
    )
    reward_tokens = np.zeros(RESPONSES.shape, np.float32)
    reward_tokens[np.arange(batch), MASK.sum(1) - 1] = REWARDS
    signals = Signals(zeros, jnp.asarray(REWARDS), jnp.asarray(reward_tokens), zeros)
    program = jax.jit(functools.partial(credit_fields, credit, None, None))
    fields, _ = program(minibatch, signals, jax.random.PRNGKey(0))
    return credit, np.asarray(fields["advantages"]), np.asarray(fields["returns"])


def test_ktae_defaults_through_the_learner_equal_the_hand_computation():
    credit, advantages, returns = learner_advantages(ktae_config())
    assert credit.recipe.estimator == "ktae" and credit.recipe.critic == "none"
    assert credit.estimator.ktae_end_tokens == (EOS,)
    expected = hand_ktae(REWARDS, RESPONSES, MASK, 4, h1=1.0, h2=1.0, h3=1.0, scale=1.0, std=True)
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)
    assert (advantages[~MASK] == 0).all() and (returns == 0).all()
    # Group 0's key tokens move its advantages off GRPO's constant per row; group 1 keeps GRPO's.
    assert np.ptp(advantages[0][MASK[0]]) > 0.1
    for row in range(4, 8):
        assert np.ptp(advantages[row][MASK[row]]) == 0


@pytest.mark.parametrize(
    "credit, weights, std",
    [
        (
            dict(ktae_fisher_weight=2.0, ktae_ig_weight=0.5, ktae_tf_weight=0.0, ktae_scale=0.5),
            dict(h1=2.0, h2=0.5, h3=0.0, scale=0.5),
            True,
        ),
        (dict(ktae_fisher_weight=0.0, ktae_tf_weight=3.0), dict(h1=0.0, h2=1.0, h3=3.0, scale=1.0), False),
    ],
)
def test_ktae_settings_reach_the_estimator(credit, weights, std):
    config = ktae_config(**credit)
    config.train.group_std_normalization = std
    _, advantages, _ = learner_advantages(config)
    expected = hand_ktae(REWARDS, RESPONSES, MASK, 4, std=std, **weights)
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)
