"""Batches with long-tailed lengths, as RL responses have them, for the sequence-packing tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from comppo_jax.models.packing import Packing, make_packing, sequence_lengths
from comppo_jax.rollout.sampler import Generation


def long_tailed_generation(vocab_size, seed=0, batch=8, prompt_width=7, response_width=40, mean_response=8.0):
    """Prompts of 3..prompt_width tokens; responses drawn exponentially (most short), row 0 at the full width."""
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(3, prompt_width + 1, batch)
    response_lengths = np.minimum(np.ceil(rng.exponential(mean_response, batch)).astype(int) + 1, response_width)
    response_lengths[0] = response_width
    width = prompt_width + response_width
    tokens = np.zeros((batch, width), np.int32)
    response = np.zeros((batch, response_width), np.int32)
    for b in range(batch):
        n = prompt_lengths[b] + response_lengths[b]
        tokens[b, :n] = rng.integers(2, vocab_size, n)
        response[b, : response_lengths[b]] = tokens[b, prompt_lengths[b] : n]
    mask = np.arange(width)[None] < (prompt_lengths + response_lengths)[:, None]
    response_mask = np.arange(response_width)[None] < response_lengths[:, None]
    return Generation(
        jnp.asarray(tokens),
        jnp.asarray(mask),
        jnp.asarray(prompt_lengths, jnp.int32),
        jnp.asarray(response),
        jnp.asarray(response_mask),
        jnp.asarray(rng.normal(size=response.shape) * response_mask, jnp.float32),
    )


def packing_of(attention_mask) -> Packing:
    """The packing of a sequence-layout batch, as device arrays."""
    mask = np.asarray(attention_mask)
    return jax.tree.map(jnp.asarray, make_packing(sequence_lengths(mask), mask.shape[1]))
