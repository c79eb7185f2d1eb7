"""The scoring pass on packed rows against the sequence layout: every field of the Rollout equal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import packed_batches
import pytest
from tiny_model import tiny_config

from comppo_jax.models import init_params
from comppo_jax.rollout import policy_gate, policy_token_stats, score_rollout

CONFIG = tiny_config(num_layers=3)


def long_tailed_generation(seed=0):
    return packed_batches.long_tailed_generation(CONFIG.vocab_size, seed)


def packing_of(generation):
    return packed_batches.packing_of(generation.attention_mask)


@pytest.mark.parametrize("backend", ["reference", pytest.param("interpret", marks=pytest.mark.slow)])
# Every case compares the Herfindahl index and the window size, whose function the default gate is.
@pytest.mark.parametrize("window,gate_statistic", [("full", "entropy"), ("response", "sink_herfindahl")])
def test_the_scoring_pass_on_packed_rows_equals_the_sequence_layout(backend, window, gate_statistic):
    generation = long_tailed_generation()
    packing = packing_of(generation)
    assert packing.segment_ids.shape[0] < generation.tokens.shape[0]  # the long tail packs
    params = init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.3)
    reference = init_params(CONFIG, jax.random.PRNGKey(1), init_std=0.3)
    options = dict(
        window=window, hidden_layers=(1, 2, 3), top_k=4, backend=backend, gate_statistic=gate_statistic, temperature=0.8
    )
    padded = score_rollout(params, reference, CONFIG, generation, **options)
    packed = score_rollout(params, reference, CONFIG, generation, packing=packing, **options)
    for name in ("log_probs", "ref_log_probs", "herfindahl", "kappa"):
        np.testing.assert_allclose(getattr(packed, name), getattr(padded, name), rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(packed.window_size, padded.window_size)
    real = np.asarray(generation.attention_mask)
    np.testing.assert_allclose(
        np.asarray(packed.hidden_states)[:, real], np.asarray(padded.hidden_states)[:, real], rtol=1e-5, atol=1e-5
    )
    valid = np.asarray(padded.routing.valid) & real[..., None]
    np.testing.assert_array_equal(np.asarray(packed.routing.valid)[real], np.asarray(padded.routing.valid)[real])
    np.testing.assert_array_equal(np.asarray(packed.routing.indices)[valid], np.asarray(padded.routing.indices)[valid])
    np.testing.assert_allclose(
        np.asarray(packed.routing.weights)[valid], np.asarray(padded.routing.weights)[valid], rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow  # the update's tests check the actor loss's gradients through the same path
def test_packed_token_stats_and_gate_equal_and_their_gradients_too():
    generation = long_tailed_generation(seed=3)
    packing = packing_of(generation)
    params = init_params(CONFIG, jax.random.PRNGKey(2), init_std=0.3)
    args = (generation.tokens, generation.attention_mask, generation.prompt_lengths, generation.response_tokens, 0.9)
    mask = generation.response_mask

    def loss(params, packing):
        log_probs, entropy = policy_token_stats(params, CONFIG, *args, packing=packing)
        return jnp.sum(jnp.where(mask, log_probs + 0.1 * entropy, 0.0))

    (value, grads), (packed_value, packed_grads) = (jax.value_and_grad(loss)(params, p) for p in (None, packing))
    np.testing.assert_allclose(packed_value, value, rtol=1e-5)
    for path, got in jax.tree_util.tree_leaves_with_path(packed_grads):
        want = dict(jax.tree_util.tree_leaves_with_path(grads))[path]
        # Within 1e-5 of the leaf's largest gradient: a sum reordered rounds at that scale, not the element's.
        atol = 1e-5 * float(np.max(np.abs(want)))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol, err_msg=jax.tree_util.keystr(path))
    gate = lambda p: policy_gate(params, CONFIG, *args[:3], mask, length=mask.shape[1], backend="reference", packing=p)
    np.testing.assert_allclose(gate(packing), gate(None), rtol=1e-5, atol=1e-6)
