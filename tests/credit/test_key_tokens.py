"""KTAE (Sun et al. 2025, arXiv 2505.16826, method section) against scipy and pure-Python transcriptions: each
statistic on hand-made tables, the contingency counts against loops, and the whole estimator against a
float64 loop over each group's token ids as the authors' released code (compute_key_tokens.py) runs it."""

from __future__ import annotations

import itertools
import math

import credit_oracles as oracle
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import expit
from scipy.stats import fisher_exact

from comppo_jax.credit import (
    bm25_term_frequency,
    direction_score,
    fisher_exact_pvalue,
    fisher_score,
    group_token_counts,
    information_gain,
    key_token_value,
    ktae_advantages,
)

K1, B0, EPS = 2.0, 0.5, 1e-5  # the released code's BM25 k1, b and ratio guard


def tables(total):
    """Every 2 x 2 table (a, b, c, d) of non-negative counts summing to `total`, as four float arrays."""
    rows = [t for t in itertools.product(range(total + 1), repeat=3) if sum(t) <= total]
    return tuple(np.array(x, np.float32) for x in zip(*[(a, b, c, total - a - b - c) for a, b, c in rows]))


def entropy_bits(x, y):
    total = x + y
    return -sum(p * math.log2(p) for p in (x / total, y / total) if p > 0) if total else 0.0


def key_values_loop(rewards, tokens, mask, group, h1=1.0, h2=1.0, h3=1.0, scale=1.0, end_tokens=()):
    """KTAE's key-token value of every valid position, float64: per group with correct (reward > 0) and
    incorrect rollouts, per token id present, the contingency table by presence, scipy's two-sided Fisher
    p-value, IG in bits, BM25 frequencies by occurrence and the released code's squashing."""
    values = np.zeros(tokens.shape)
    for start in range(0, len(rewards), group):
        rows = range(start, start + group)
        seqs = {r: [int(t) for t, m in zip(tokens[r], mask[r]) if m] for r in rows}
        right = [r for r in rows if rewards[r] > 0]
        wrong = [r for r in rows if rewards[r] <= 0]
        if not right or not wrong:
            continue
        len_t, len_f = sum(len(seqs[r]) for r in right), sum(len(seqs[r]) for r in wrong)
        average = (len_t + len_f) / 2

        def bm25(count, length):
            tf = count / length if length else 0.0
            return tf * (K1 + 1) / (tf + K1 * (1 - B0 + B0 * length / average)) if length else 0.0

        for token in {t for s in seqs.values() for t in s}:
            a, b = sum(token in seqs[r] for r in right), sum(token in seqs[r] for r in wrong)
            c, d = len(right) - a, len(wrong) - b
            p = fisher_exact([[a, b], [c, d]]).pvalue
            fisher = 0.0 if math.isclose(p, 1.0) else math.exp(-2 * p)
            ig = (
                entropy_bits(a + c, b + d) - (a + b) / group * entropy_bits(a, b) - (c + d) / group * entropy_bits(c, d)
            )
            tf_t = bm25(sum(seqs[r].count(token) for r in right), len_t)
            tf_f = bm25(sum(seqs[r].count(token) for r in wrong), len_f)
            direction = math.asin(math.sqrt(a / (a + c))) - math.asin(math.sqrt(b / (b + d)))
            direction += h3 * (tf_t / (tf_f + EPS) - tf_f / (tf_t + EPS))
            strength = (h1 * fisher + h2 * ig) / ((h1 + h2) or 1.0)
            value = 0.0 if token in end_tokens else 2 * scale * (expit(strength * direction) - 0.5)
            for r in rows:
                values[r] = np.where(mask[r] & (tokens[r] == token), value, values[r])
    return values


def ktae_loop(rewards, tokens, mask, group, **weights):
    """GRPO's advantage (credit_oracles.grpo) on the valid tokens plus the key-token values."""
    grpo = oracle.grpo(rewards, group)[:, None] * mask
    return grpo + key_values_loop(rewards, tokens, mask, group, **weights)


def random_batch(seed, groups, group, length, vocab):
    """Rewards in {1, 0.7, 0, -0.5} (correct, correct with a length penalty, incorrect, malformed),
    right-padded token ids in [1, vocab), one group all correct when there are several."""
    rng = np.random.default_rng(seed)
    rewards = rng.choice(np.array([1.0, 0.7, 0.0, -0.5], np.float32), size=groups * group)
    if groups > 1:
        rewards[:group] = 1.0
    tokens = rng.integers(1, vocab, size=(groups * group, length))
    mask = np.arange(length)[None] < rng.integers(1, length + 1, size=(groups * group, 1))
    return rewards, np.where(mask, tokens, 0).astype(np.int32), mask


@pytest.mark.parametrize("seed", range(3))
def test_counts_match_a_loop_over_each_groups_rollouts(seed):
    rewards, tokens, mask = random_batch(seed, groups=3, group=4, length=9, vocab=6)
    counts = group_token_counts(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(rewards > 0), 4)
    for row, t in zip(*np.nonzero(mask)):
        rows = range(row - row % 4, row - row % 4 + 4)
        token = tokens[row, t]
        has = {r: token in tokens[r][mask[r]] for r in rows}
        count = {r: int((tokens[r][mask[r]] == token).sum()) for r in rows}
        right = [r for r in rows if rewards[r] > 0]
        wrong = [r for r in rows if rewards[r] <= 0]
        expected = (
            sum(has[r] for r in right),
            sum(has[r] for r in wrong),
            sum(not has[r] for r in right),
            sum(not has[r] for r in wrong),
            sum(count[r] for r in right),
            sum(count[r] for r in wrong),
        )
        got = [float(x[row, t]) for x in counts[:6]]
        assert got == list(expected), (row, t)
        assert float(counts.length_correct[row, 0]) == sum(mask[r].sum() for r in right)
        assert float(counts.length_wrong[row, 0]) == sum(mask[r].sum() for r in wrong)
    padding = ~mask
    assert all(float(np.abs(np.asarray(x)[padding]).max(initial=0)) == 0 for x in counts[:6])


@pytest.mark.parametrize("total", [1, 2, 5, 8, 16])
def test_fisher_pvalue_is_scipys_two_sided_on_every_table(total):
    a, b, c, d = tables(total)
    got = np.asarray(fisher_exact_pvalue(a, b, c, d, total))
    expected = [fisher_exact([[w, x], [y, z]]).pvalue for w, x, y, z in zip(a, b, c, d)]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_fisher_pvalue_by_hand():
    # [[3, 0], [0, 3]]: P = 3! 3! 3! 3! / (3! 0! 0! 3! 6!) = 1/20, and its mirror [[0, 3], [3, 0]] as extreme.
    p = fisher_exact_pvalue(jnp.array([3.0]), jnp.array([0.0]), jnp.array([0.0]), jnp.array([3.0]), 6)
    np.testing.assert_allclose(np.asarray(p), [2 / 20], rtol=1e-5)


def test_fisher_score_transforms_the_pvalue_and_drops_no_association():
    p = jnp.array([0.0, 0.1, 0.5, 1.0 - 1e-6, 1.0])
    np.testing.assert_allclose(np.asarray(fisher_score(p)), [1.0, math.exp(-0.2), math.exp(-1.0), 0.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("total", [1, 4, 7])
def test_information_gain_is_the_mutual_information_in_bits(total):
    a, b, c, d = tables(total)
    got = np.asarray(information_gain(a, b, c, d))
    for i, cells in enumerate(zip(a, b, c, d)):
        # I(X; Y) = sum p(x, y) log2 p(x, y) / (p(x) p(y)): the joint table read as a distribution.
        w, x, y, z = (v / total for v in cells)
        joint = {(1, 1): w, (1, 0): x, (0, 1): y, (0, 0): z}
        px = {1: w + x, 0: y + z}
        py = {1: w + y, 0: x + z}
        mutual = sum(p * math.log2(p / (px[i_] * py[j_])) for (i_, j_), p in joint.items() if p > 0)
        assert got[i] == pytest.approx(mutual, abs=1e-5), cells


def test_information_gain_by_hand():
    # 2 correct rollouts both with the token, 2 incorrect both without: the token tells correctness (1 bit).
    ig = information_gain(*(jnp.array([v]) for v in (2.0, 0.0, 0.0, 2.0)))
    assert float(ig[0]) == pytest.approx(1.0, abs=1e-6)
    assert float(information_gain(*(jnp.zeros(1),) * 4)[0]) == 0.0


def test_bm25_term_frequency_by_hand():
    # 3 occurrences in 12 correct tokens, the incorrect ones 4 tokens long: tf = 1/4, len_avg = 8.
    got = bm25_term_frequency(jnp.array([3.0, 0.0]), jnp.array([12.0, 0.0]), jnp.array([8.0, 8.0]))
    tf = 0.25
    expected = tf * (K1 + 1) / (tf + K1 * (1 - B0 + B0 * 12 / 8))
    np.testing.assert_allclose(np.asarray(got), [expected, 0.0], rtol=1e-6)


def test_direction_score_by_hand():
    a, b, c, d, tf_t, tf_f = (jnp.array([v]) for v in (3.0, 1.0, 1.0, 3.0, 0.2, 0.1))
    expected = math.asin(math.sqrt(3 / 4)) - math.asin(math.sqrt(1 / 4)) + 0.5 * (0.2 / (0.1 + EPS) - 0.1 / (0.2 + EPS))
    assert float(direction_score(a, b, c, d, tf_t, tf_f, 0.5)[0]) == pytest.approx(expected, rel=1e-6)


def test_key_token_value_by_hand():
    fisher, ig, direction = jnp.array([0.6]), jnp.array([0.3]), jnp.array([-2.0])
    strength = (2.0 * 0.6 + 1.0 * 0.3) / 3.0
    expected = 2 * 0.5 * (1 / (1 + math.exp(2.0 * strength)) - 0.5)
    got = key_token_value(fisher, ig, direction, fisher_weight=2.0, ig_weight=1.0, scale=0.5)
    assert float(got[0]) == pytest.approx(expected, rel=1e-6)
    assert float(key_token_value(fisher, ig, direction, 0.0, 0.0)[0]) == 0.0  # no strength: GRPO alone
    huge = key_token_value(jnp.ones(2), jnp.ones(2), jnp.array([1e6, -1e6]), scale=0.5)
    np.testing.assert_allclose(np.asarray(huge), [0.5, -0.5])  # saturates at +-scale


@pytest.mark.parametrize(
    "seed, groups, group, weights",
    [
        (0, 3, 4, {}),
        (1, 2, 8, {}),
        (2, 2, 4, dict(h1=2.0, h2=0.5, h3=0.0, scale=0.5)),
        (3, 3, 4, dict(h1=0.0, h2=1.0, h3=3.0, end_tokens=(2,))),
    ],
)
def test_ktae_advantages_match_the_released_codes_loop(seed, groups, group, weights):
    rewards, tokens, mask = random_batch(seed, groups, group, length=10, vocab=7)
    names = dict(h1="fisher_weight", h2="ig_weight", h3="tf_weight", scale="scale", end_tokens="end_tokens")
    got = ktae_advantages(
        jnp.asarray(rewards), jnp.asarray(tokens), jnp.asarray(mask), group, **{names[k]: v for k, v in weights.items()}
    )
    np.testing.assert_allclose(
        np.asarray(got), ktae_loop(rewards, tokens, mask, group, **weights), rtol=1e-4, atol=1e-5
    )


def test_hand_made_group():
    """One group of 4: rollouts 0 and 2 correct. Token 6 is in both correct rollouts and no incorrect one,
    token 9 in one of each, token 2 ends every rollout (the end token: no value), 0 pads."""
    tokens = np.array([[5, 6, 5, 2, 0], [5, 7, 2, 0, 0], [6, 6, 8, 9, 2], [5, 9, 9, 2, 0]], np.int32)
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], bool)
    rewards = np.array([1.0, 0.0, 1.0, -0.5], np.float32)
    got = np.asarray(ktae_advantages(jnp.asarray(rewards), jnp.asarray(tokens), jnp.asarray(mask), 4, end_tokens=(2,)))
    np.testing.assert_allclose(got, ktae_loop(rewards, tokens, mask, 4, end_tokens=(2,)), rtol=1e-5, atol=1e-6)
    grpo = oracle.grpo(rewards, 4)
    assert got[0, 3] == pytest.approx(grpo[0]) and got[2, 4] == pytest.approx(grpo[2])  # end token: GRPO only
    assert (got[~mask] == 0).all()
    # Token 6: a=2, b=0, c=0, d=2; Fisher p = 2 * (1/6) = 1/3, IG = 1 bit; TF_F = 0, so D is large: value ~ +1.
    assert got[0, 1] - grpo[0] == pytest.approx(1.0, abs=1e-3)
    assert got[2, 0] - grpo[2] == pytest.approx(1.0, abs=1e-3)


def test_a_group_without_both_outcomes_keeps_grpos_advantage():
    rewards = np.array([1.0, 0.5, 1.0, 1.0, 0.0, -0.5, 0.0, 0.0], np.float32)  # all correct; all incorrect
    tokens = np.arange(1, 25, dtype=np.int32).reshape(8, 3) % 5
    mask = np.ones((8, 3), bool)
    got = ktae_advantages(jnp.asarray(rewards), jnp.asarray(tokens), jnp.asarray(mask), 4)
    np.testing.assert_allclose(np.asarray(got), np.repeat(oracle.grpo(rewards, 4)[:, None], 3, 1), rtol=1e-5, atol=1e-6)


def test_token_ids_are_only_labels():
    """Counts come from sorting ids, not from a vocabulary-sized table: Qwen3-sized ids give the same values."""
    rewards, tokens, mask = random_batch(4, groups=2, group=4, length=8, vocab=6)
    relabelled = np.where(mask, 151_000 - 997 * tokens, 0).astype(np.int32)
    args = (jnp.asarray(rewards),)
    small = ktae_advantages(*args, jnp.asarray(tokens), jnp.asarray(mask), 4)
    large = ktae_advantages(*args, jnp.asarray(relabelled), jnp.asarray(mask), 4)
    np.testing.assert_array_equal(np.asarray(small), np.asarray(large))


def test_bad_inputs_are_named():
    rewards, mask = jnp.ones(4), jnp.ones((4, 3), bool)
    with pytest.raises(ValueError, match="tokens must be integer token ids"):
        ktae_advantages(rewards, jnp.ones((4, 3)), mask, 2)
    with pytest.raises(ValueError, match="group_size must be a positive int dividing"):
        ktae_advantages(rewards, jnp.ones((4, 3), jnp.int32), mask, 3)
    with pytest.raises(ValueError, match="mask has shape .* but tokens has shape"):
        ktae_advantages(rewards, jnp.ones((4, 2), jnp.int32), mask, 2)
