"""Chunked log-probs and entropies over the vocabulary against the dense [B, T, V] computation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comppo_jax.credit import entropy_from_logits
from comppo_jax.models import ModelConfig, forward, init_params
from comppo_jax.rollout import gather_response, policy_token_stats, response_token_stats

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def batch(seed=0, prompt=6, length=23):
    rng = np.random.default_rng(seed)
    prompt_lengths = np.array([prompt, prompt - 2, prompt])
    response_lengths = np.array([length, 11, 17])
    total = prompt + length
    tokens = rng.integers(0, CONFIG.vocab_size, (3, total)).astype(np.int32)
    mask = np.arange(total)[None] < (prompt_lengths + response_lengths)[:, None]
    response = np.stack(
        [
            np.pad(tokens[i, p : p + length], (0, max(0, p + length - total)))[:length]
            for i, p in enumerate(prompt_lengths)
        ]
    )
    return tuple(jnp.asarray(x) for x in (tokens, mask, prompt_lengths, response))


def dense_stats(params, config, tokens, mask, prompt_lengths, response, temperature):
    logits = gather_response(forward(params, config, tokens, mask).logits, prompt_lengths, response.shape[1])
    log_probs = jax.nn.log_softmax(logits / temperature)
    return jnp.take_along_axis(log_probs, response[..., None], -1)[..., 0], entropy_from_logits(logits / temperature)


def loss(stats):
    return lambda params: sum(jnp.sum(s * w) for s, w in zip(stats(params), (1.0, 0.3)))


@functools.cache
def dense_expected():
    """(params, batch, the dense log-probs and entropies, their loss's gradient): the same for every chunk size."""
    params = init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.2)
    tokens, mask, prompt_lengths, response = batch()
    expected = dense_stats(params, CONFIG, tokens, mask, prompt_lengths, response, 0.7)
    dense_grad = jax.jit(jax.grad(loss(lambda p: dense_stats(p, CONFIG, tokens, mask, prompt_lengths, response, 0.7))))(
        params
    )
    return params, (tokens, mask, prompt_lengths, response), expected, dense_grad


# 0: no chunking; 5: chunks that do not divide the 23 response positions; 64: longer than them (one chunk).
@pytest.mark.parametrize("chunk", [0, 5, 64])
def test_chunked_log_probs_and_entropy_equal_the_dense_ones_with_gradients(chunk):
    params, (tokens, mask, prompt_lengths, response), expected, dense_grad = dense_expected()
    config = CONFIG.replace(logits_chunk=chunk)
    got = policy_token_stats(params, config, tokens, mask, prompt_lengths, response, 0.7)
    for name, value, wanted in zip(("log_probs", "entropy"), got, expected):
        assert value.shape == response.shape and value.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(value), np.asarray(wanted), atol=2e-5, err_msg=name)

    # Gradients jitted: one program each, not every op of the backward pass compiled on its own.
    chunked_grad = jax.jit(
        jax.grad(loss(lambda p: policy_token_stats(p, config, tokens, mask, prompt_lengths, response, 0.7)))
    )(params)
    for (path, grad), wanted in zip(jax.tree_util.tree_leaves_with_path(chunked_grad), jax.tree.leaves(dense_grad)):
        np.testing.assert_allclose(np.asarray(grad), np.asarray(wanted), atol=3e-5, err_msg=jax.tree_util.keystr(path))


def test_chunked_vocabulary_gradient_never_holds_the_full_logits():
    config = CONFIG.replace(vocab_size=8192)
    params = init_params(config, jax.random.PRNGKey(0))
    hidden = jnp.ones((2, 512, config.hidden_size), jnp.float32)
    prompt_lengths = jnp.ones((2,), jnp.int32)
    response = jnp.zeros((2, 500), jnp.int32)
    logits_bytes = 2 * 500 * 8192 * 4  # one float32 [B, T, V] tensor

    def temp(chunk):
        loss = lambda params: response_token_stats(
            params, config.replace(logits_chunk=chunk), hidden, prompt_lengths, response
        )[0].sum()
        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temp(0) >= logits_bytes  # unchunked holds [B, T, V] (the check has teeth)
    assert temp(50) < logits_bytes / 4, (temp(50), temp(0))
