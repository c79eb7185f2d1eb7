"""The future attention influence (Li et al. 2025, Def. 4.2) of the scoring pass against NumPy on the
materialized final-layer attention of a tiny random model: ragged prompts and responses, right padding,
the sequence layout and packed rows, the blockwise pass at several block sizes and horizons."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import packed_batches
import pytest
from attention_anchor_oracles import fai, head_mean_attention, materialized_influence
from tiny_model import tiny_config

from comppo_jax.credit.attention_credit import future_attention_influence
from comppo_jax.models import init_params
from comppo_jax.rollout import score_rollout
from pallas_kernels import attention_with_concentration

CONFIG = tiny_config(num_layers=3)


def random_inputs(seed=0, batch=3, length=37, heads=4, kv_heads=2, dim=8):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), jnp.float32)
    real = np.asarray([37, 29, 12])
    mask = jnp.asarray(np.arange(length)[None] < real[:, None])
    return q, k, mask, np.asarray([5, 11, 3]), real


@pytest.mark.parametrize("horizon,block", [((1, 5), 8), ((3, 20), 16), ((0, 0), 8), ((10, 100), 128)])
def test_the_blockwise_pass_equals_the_materialized_attention(horizon, block):
    q, k, mask, starts, real = random_inputs()
    lse = attention_with_concentration(q, k, k, mask, jnp.asarray(starts), backend="reference", return_lse=True)[3]
    got = future_attention_influence(q, k, lse, mask, jnp.asarray(starts), horizon=horizon, block=block)
    attention = head_mean_attention(q, k, mask)
    # Every key position's, the prompt's too (the response attends to it); 0 on padding.
    expected = [[fai(attention, starts, real, b, s, horizon) for s in range(q.shape[1])] for b in range(len(starts))]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert np.count_nonzero(expected) > 10


def test_an_inverted_horizon_is_refused():
    q, k, mask, starts, _ = random_inputs()
    lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]))
    with pytest.raises(ValueError, match="0 <= H_lo <= H_hi"):
        future_attention_influence(q, k, lse, mask, jnp.asarray(starts), horizon=(5, 2))


@pytest.mark.parametrize("packed", [False, True])
def test_the_scoring_pass_reads_each_response_token_s_influence(packed):
    """score_rollout(influence_horizon=...) on ragged, right-padded rows (and packed): Rollout.influence [B, T]
    is Def. 4.2 on the final layer's materialized, head-averaged attention, at each token's own position."""
    generation = packed_batches.long_tailed_generation(CONFIG.vocab_size, seed=4)
    packing = packed_batches.packing_of(generation.attention_mask) if packed else None
    params = init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)
    horizon = (2, 9)
    rollout = score_rollout(
        params, None, CONFIG, generation, top_k=None, backend="reference", influence_horizon=horizon, packing=packing
    )
    lengths = np.asarray(generation.response_mask).sum(1)
    expected = materialized_influence(params, CONFIG, generation, lengths, horizon, generation.response_mask.shape[1])
    np.testing.assert_allclose(rollout.influence, expected, rtol=1e-4, atol=1e-7)
    # The long row's early tokens see their whole horizon, its last two none: they are 0, as is padding.
    assert np.all(expected[0, : lengths[0] - 2] > 0) and np.all(expected[0, lengths[0] - 2 :] == 0)


def test_without_a_horizon_there_is_no_influence_and_it_needs_the_behaviour_pass():
    generation = packed_batches.long_tailed_generation(CONFIG.vocab_size, seed=4)
    params = init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)
    assert score_rollout(params, None, CONFIG, generation, top_k=None, backend="reference").influence is None
    with pytest.raises(ValueError, match="influence_horizon reads the behaviour policy's attention"):
        score_rollout(
            params,
            None,
            CONFIG,
            generation,
            top_k=None,
            old_log_probs="sampler",
            behaviour_pass=False,
            influence_horizon=(1, 4),
        )
