"""KTAE: key-token advantages from a group's rollouts (Sun et al., 2025, "KTAE: A Model-Free Algorithm to
Key-Tokens Advantage Estimation in Mathematical Reasoning", NeurIPS 2025, arXiv 2505.16826, method section).

For the G rollouts of one prompt, split into correct (x_T) and incorrect (x_F), every token id o of the
group gets a 2 x 2 contingency table of rollouts (method section, "contingency table"):

    a = |{correct rollouts containing o}|      b = |{incorrect rollouts containing o}|
    c = |x_T| - a                              d = |x_F| - b,        a + b + c + d = G,

two association strengths (Fisher's exact test, information gain), a direction (the arcsine difference of
the two presence rates plus a BM25-normalized frequency ratio), and from them a key-token value in
(-scale, scale) that is added to the rollout's GRPO advantage at every position holding o.

Details the paper leaves open follow the authors' released code (github.com/ZNLP/KTAE, mirrored as
xiaolizh1/KTAE: verl/workers/actor/compute_key_tokens.py and verl/trainer/ppo/core_algos.py
`compute_ktae_outcome_advantage_and_keytokens`): a rollout is correct when its reward is > 0; a, b count
rollouts by presence, BM25's term frequencies count occurrences; the factorials are lgamma's; a group
without both correct and incorrect rollouts gets no key-token values; the end-of-sequence token's value is 0.

Counts are found per position by sorting each group's (token id, row) keys, so memory is O(B T) whatever
the vocabulary (151K for Qwen3): never [B, T, V], nor [groups, V]. Everything is float32 and jittable.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

from comppo_jax.credit import _validation
from comppo_jax.credit.advantages import grpo_advantages

BM25_K1 = 2.0  # the released code's BM25 saturation k1
BM25_B = 0.5  # ... and its length normalization b
RATIO_EPS = 1e-5  # the released code's guard of the frequency ratios TF_T / TF_F (a token absent from x_F)
# pmf(k) <= pmf(observed) up to float32's lgamma error: exact ties belong to the two-sided p-value.
_LOG_TIE = 1e-4
# p = 1 exactly when the observed table is a mode; otherwise p <= 1 - pmf(mode) <= 1 - 1 / (G + 1),
# so this margin only absorbs rounding.
_P_ONE = 1e-3


class TokenCounts(NamedTuple):
    """Per response position [B, T], its token id's statistics within its group (padding: zeros).

    a, b, c, d: the contingency table; tf_correct, tf_wrong: the id's occurrences in the group's correct /
    incorrect rollouts; length_correct, length_wrong [B, 1]: the group's valid tokens in those rollouts."""

    a: Float[Array, "B T"]
    b: Float[Array, "B T"]
    c: Float[Array, "B T"]
    d: Float[Array, "B T"]
    tf_correct: Float[Array, "B T"]
    tf_wrong: Float[Array, "B T"]
    length_correct: Float[Array, "B 1"]
    length_wrong: Float[Array, "B 1"]


def _starts(x: Array) -> Bool[Array, "G N"]:
    """Where a sorted row's value differs from the one before it (the first position included)."""
    return jnp.concatenate([jnp.ones_like(x[:, :1], bool), x[:, 1:] != x[:, :-1]], axis=1)


def group_token_counts(
    tokens: Int[Array, "B T"], mask: Shaped[Array, "B T"], correct: Bool[Array, " B"], group: int
) -> TokenCounts:
    """The contingency table of each position's token id among its group's rollouts (KTAE method section),
    plus the id's occurrences in the correct and incorrect rollouts (BM25's tf).

    Rows of one prompt's group are consecutive (`group` of them). Sorting each group's keys
    token id * group + row lines up an id's positions row by row, so an id's rollouts are its runs of
    distinct keys and its occurrences its run of equal ids."""
    _validation.check_rank("tokens", tokens, 2, "[B, T]")
    _validation.check_same_shape("tokens", tokens, mask=mask)
    batch, length = tokens.shape
    groups, size = batch // group, group * length
    valid = mask.astype(bool).reshape(groups, size)
    row = jnp.broadcast_to((jnp.arange(batch) % group)[:, None], (batch, length)).reshape(groups, size)
    key = jnp.where(valid, tokens.astype(jnp.int32).reshape(groups, size) * group + row, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, axis=1)
    key, valid = jnp.take_along_axis(key, order, axis=1), jnp.take_along_axis(valid, order, axis=1)
    is_correct = jnp.take_along_axis(correct.reshape(groups, group), key % group, axis=1) & valid
    is_wrong = ~is_correct & valid
    first_in_row = _starts(key) & valid  # a rollout counts once however often it repeats the id
    segment = jnp.cumsum(_starts(key // group), axis=1) - 1 + (jnp.arange(groups) * size)[:, None]

    def per_position(x: Array) -> Float[Array, "B T"]:
        totals = jax.ops.segment_sum(x.astype(jnp.float32).ravel(), segment.ravel(), num_segments=batch * length)
        sorted_totals = jnp.where(valid, totals[segment], 0.0)
        return (
            jnp.zeros_like(sorted_totals)
            .at[jnp.arange(groups)[:, None], order]
            .set(sorted_totals)
            .reshape(batch, length)
        )

    def per_row(x: Array) -> Float[Array, "B 1"]:
        return jnp.repeat(x.reshape(groups, group).sum(axis=1), group)[:, None]

    valid_rows = mask.astype(jnp.float32).sum(axis=1)
    n_correct, n_wrong = per_row(correct.astype(jnp.float32)), per_row(1.0 - correct.astype(jnp.float32))
    a, b = per_position(first_in_row & is_correct), per_position(first_in_row & is_wrong)
    on = mask.astype(bool)
    return TokenCounts(
        a,
        b,
        jnp.where(on, n_correct - a, 0.0),
        jnp.where(on, n_wrong - b, 0.0),
        per_position(is_correct),
        per_position(is_wrong),
        per_row(jnp.where(correct, valid_rows, 0.0)),
        per_row(jnp.where(correct, 0.0, valid_rows)),
    )


def _log_choose(n: Array, k: Array) -> Array:
    """log C(n, k) by lgamma (Gamma(z + 1) = z!), exact-enough for float counts."""
    return jax.lax.lgamma(n + 1.0) - jax.lax.lgamma(k + 1.0) - jax.lax.lgamma(n - k + 1.0)


@functools.partial(jax.jit, static_argnames=("total",))
def fisher_exact_pvalue(a: Array, b: Array, c: Array, d: Array, total: int) -> Array:
    """Two-sided p-value of Fisher's exact test of the 2 x 2 tables [[a, b], [c, d]] (elementwise):

        Fisher = sum_k P(k) over k with P(k) <= P(a),
        P(k) = (a+b)! (c+d)! (a+c)! (b+d)! / (k! (a+b-k)! (a+c-k)! (d-a+k)! N!),

    KTAE method section ("Fisher's exact test", whose P(a) is the paper's Fisher(o)), summed over the tables
    with the same margins as the released code and scipy.stats.fisher_exact do; factorials in log space.
    `total` (static) bounds N = a + b + c + d (the group size): the loop over k runs to it."""
    a, b, c, d = (jnp.asarray(x, jnp.float32) for x in (a, b, c, d))
    row, col, n = a + b, a + c, a + b + c + d
    low, high = jnp.maximum(0.0, row + col - n), jnp.minimum(row, col)

    def log_pmf(k: Array) -> Array:
        return _log_choose(col, k) + _log_choose(n - col, row - k) - _log_choose(n, row)

    observed = log_pmf(a)

    def add(k: Array, p: Array) -> Array:
        inside = (k >= low) & (k <= high)
        log_p = log_pmf(jnp.clip(k, low, high))
        return p + jnp.where(inside & (log_p <= observed + _LOG_TIE), jnp.exp(log_p), 0.0)

    p = jax.lax.fori_loop(0, total + 1, lambda k, p: add(k.astype(jnp.float32), p), jnp.zeros(a.shape))
    return jnp.minimum(p, 1.0)


def fisher_score(p_value: Array) -> Array:
    """F = exp(-2 Fisher), and 0 where Fisher = 1 (no association at all): KTAE method section's transform of
    the test into an association strength in [exp(-2), 1) (the released code's `format_fisher_pvalue`)."""
    return jnp.where(p_value >= 1.0 - _P_ONE, 0.0, jnp.exp(-2.0 * p_value))


def _entropy_bits(x: Array, y: Array) -> Array:
    """Entropy in bits of the split (x, y) of a count; 0 for an empty one."""
    total = x + y
    p = x / jnp.where(total > 0, total, 1.0)
    return (jax.scipy.special.entr(p) + jax.scipy.special.entr(1.0 - p)) / jnp.log(2.0)


def information_gain(a: Array, b: Array, c: Array, d: Array) -> Array:
    """IG(o) = H(Y) - H(Y | X_o) in bits, Y the rollouts' correctness and X_o whether they contain o:

        H(Y) = H(a + c, b + d),  H(Y | X_o) = (a + b) / N H(a, b) + (c + d) / N H(c, d),

    KTAE method section ("information gain"); 0 for an empty table."""
    n = a + b + c + d
    safe_n = jnp.where(n > 0, n, 1.0)
    conditional = (a + b) / safe_n * _entropy_bits(a, b) + (c + d) / safe_n * _entropy_bits(c, d)
    return jnp.where(n > 0, _entropy_bits(a + c, b + d) - conditional, 0.0)


def bm25_term_frequency(
    count: Array, length: Array, average_length: Array, k1: float = BM25_K1, b: float = BM25_B
) -> Array:
    """TF(o) = (k1 + 1) tf / (k1 (1 - b + b len / len_avg) + tf), tf = count / len: BM25's saturated
    frequency of o in the concatenated correct (or incorrect) rollouts of length len, len_avg the mean of
    the two lengths (KTAE method section, "direction"; tf relative to len as in the released `compute_tf`)."""
    safe = jnp.where(length > 0, length, 1.0)
    tf = count / safe
    return jnp.where(length > 0, tf * (k1 + 1.0) / (tf + k1 * (1.0 - b + b * length / average_length)), 0.0)


def direction_score(
    a: Array, b: Array, c: Array, d: Array, tf_correct: Array, tf_wrong: Array, tf_weight: float = 1.0
) -> Array:
    """D(o) = asin sqrt(a / (a + c)) - asin sqrt(b / (b + d)) + h3 (TF_T / TF_F - TF_F / TF_T), KTAE
    method section ("direction"): the difference of the presence rates among correct and incorrect rollouts
    (Cohen's h, halved, as in the paper and code) plus the BM25 frequency ratio, each ratio's denominator
    guarded by RATIO_EPS as the released code does (TF_F = 0 for a token only correct rollouts use)."""
    rate = lambda k, m: k / jnp.where(k + m > 0, k + m, 1.0)
    cohen = jnp.arcsin(jnp.sqrt(rate(a, c))) - jnp.arcsin(jnp.sqrt(rate(b, d)))
    return cohen + tf_weight * (tf_correct / (tf_wrong + RATIO_EPS) - tf_wrong / (tf_correct + RATIO_EPS))


def key_token_value(
    fisher: Array,
    info_gain: Array,
    direction: Array,
    fisher_weight: float = 1.0,
    ig_weight: float = 1.0,
    scale: float = 1.0,
) -> Array:
    """Key-token value 2 s (sigmoid((h1 F + h2 IG) D / (h1 + h2)) - 1/2) in (-s, s): the association
    strength times its direction, squashed (KTAE method section, "key-token value"; the weights normalized and
    the range doubled to (-s, s) as in the released code, s its `top`; transcriptions of the paper write
    sigmoid((h1 F + h2 IG) D) - 1/2)."""
    norm = fisher_weight + ig_weight or 1.0  # both weights 0: no strength, value 0
    strength = (fisher_weight * fisher + ig_weight * info_gain) / norm
    return 2.0 * scale * (jax.nn.sigmoid(strength * direction) - 0.5)


@functools.partial(
    jax.jit,
    static_argnames=(
        "group_size",
        "normalize_std",
        "fisher_weight",
        "ig_weight",
        "tf_weight",
        "scale",
        "end_tokens",
    ),
)
def ktae_advantages(
    rewards: Float[Array, " B"],
    tokens: Int[Array, "B T"],
    mask: Shaped[Array, "B T"],
    group_size: int,
    normalize_std: bool = True,
    fisher_weight: float = 1.0,
    ig_weight: float = 1.0,
    tf_weight: float = 1.0,
    scale: float = 1.0,
    end_tokens: tuple[int, ...] = (),
) -> Float[Array, "B T"]:
    """KTAE's token-level advantage, A_{i,j} = A_i^GRPO + KeyTokenValue(o_ij) (KTAE method section, the final
    advantage): each row's group-relative advantage (`grpo_advantages`, with the std unless
    normalize_std=False) plus, at each valid position, the key-token value of its token id within the
    row's group (`key_token_value` of `fisher_score`, `information_gain`, `direction_score`).

    A rollout is correct when its reward is > 0 (our rewards: 1 - length penalty >= 0 correct, 0 or the
    negative format penalty otherwise; the released code's threshold). A group without both correct and
    incorrect rollouts (or of one rollout) gets no key-token values, nor do `end_tokens` (the released
    code zeroes Qwen's end-of-text id) and padding (advantage 0)."""
    _validation.check_rank("tokens", tokens, 2, "[B, T]")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer token ids, got {tokens.dtype} (shape {tuple(tokens.shape)})")
    rollout = grpo_advantages(rewards, group_size, mask, normalize_std=normalize_std)  # checks shapes, group
    correct = rewards > 0.0
    counts = group_token_counts(tokens, mask, correct, group_size)
    a, b, c, d = counts.a, counts.b, counts.c, counts.d
    average_length = (counts.length_correct + counts.length_wrong) / 2.0
    direction = direction_score(
        a,
        b,
        c,
        d,
        bm25_term_frequency(counts.tf_correct, counts.length_correct, average_length),
        bm25_term_frequency(counts.tf_wrong, counts.length_wrong, average_length),
        tf_weight,
    )
    fisher = fisher_score(fisher_exact_pvalue(a, b, c, d, group_size))
    value = key_token_value(fisher, information_gain(a, b, c, d), direction, fisher_weight, ig_weight, scale)
    both = (a + c > 0) & (b + d > 0)  # the row's group has correct and incorrect rollouts
    keyed = both & mask.astype(bool) & ~jnp.isin(tokens, jnp.asarray(end_tokens, jnp.int32))
    return rollout + jnp.where(keyed, value, 0.0)
