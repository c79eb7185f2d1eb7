"""The dense reference sampler: one contiguous KV cache of `P + max_new_tokens` slots per row.

The rollout engine (`comppo_jax.rollout.generate`) is tested and benchmarked against it: every
decode step attends over the whole cache, each prompt is prefilled once per sample, and a batch
runs until its longest row ends. Same contract and outputs as `generate` (greedy tokens are
identical; sampled tokens differ because one key per step serves the whole batch).

Rows are laid out as DESIGN.md's rollouts: `prompt (P_b real tokens) + response y_1..y_T +
right padding`. Prompts may come left- or right-padded; they are left-aligned internally so one
cache slot serves every row. Responses stop at the first EOS (kept, and counted in the response)
or at `max_new_tokens`. `num_samples` responses per prompt are consecutive rows (a GRPO group).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from comppo_jax.models.config import ModelConfig
from comppo_jax.models.kv_cache import decode_step, prefill
from comppo_jax.rollout.engine import right_align_prompts, sample_token
from comppo_jax.rollout.sampler import Generation, assemble, check_and_default


def left_align(
    tokens: Int[Array, "B P"], mask: Bool[Array, "B P"], pad_token_id: int
) -> tuple[Int[Array, "B P"], Bool[Array, "B P"]]:
    """Moves each row's real tokens to the end (stable), whatever its padding side."""
    order = jnp.argsort(mask.astype(jnp.int32), axis=1, stable=True)
    aligned_mask = jnp.take_along_axis(mask, order, 1)
    return jnp.where(aligned_mask, jnp.take_along_axis(tokens, order, 1), pad_token_id), aligned_mask


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "max_new_tokens",
        "temperature",
        "top_p",
        "num_samples",
        "eos_token_ids",
        "pad_token_id",
    ),
)
def generate_dense(
    params: dict,
    config: ModelConfig,
    prompt_tokens: Int[Array, "B P"],
    prompt_mask: Bool[Array, "B P"],
    rng: PRNGKeyArray,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    num_samples: int = 1,
    eos_token_ids: tuple[int, ...] | None = None,
    pad_token_id: int | None = None,
) -> Generation:
    """Samples `num_samples` responses per prompt.

    prompt_tokens [B, P] int, prompt_mask [B, P] bool (either padding side); rng a PRNG key.
    temperature 0 is greedy; top_p < 1 is nucleus sampling (the paper: 1.0 / 0.7). EOS ids and
    the pad id default to the model config's. Deterministic for a given rng. Log-probs are
    those of the sampled token under softmax(logits / temperature), before top-p truncation,
    which is what a teacher-forced scoring pass at the same temperature recomputes (greedy
    decoding reports temperature-1 log-probs).
    """
    eos, pad = check_and_default(config, prompt_tokens, prompt_mask, eos_token_ids, pad_token_id)
    log_prob_temperature = temperature if temperature > 0 else 1.0  # greedy reports the policy's own log-probs
    tokens = jnp.repeat(prompt_tokens.astype(jnp.int32), num_samples, axis=0)
    mask = jnp.repeat(prompt_mask.astype(bool), num_samples, axis=0)
    tokens, mask = left_align(tokens, mask, pad)
    batch, prompt_slots = tokens.shape
    logits, cache = prefill(params, config, tokens, mask, prompt_slots + max_new_tokens)

    def keep_going(state: tuple[Any, ...]) -> Array:
        step, _, _, done, *_ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state: tuple[Any, ...]) -> tuple[Any, ...]:
        step, cache, logits, done, response, log_probs, rng = state
        rng, key = jax.random.split(rng)
        token = sample_token(key, logits, temperature, top_p)
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits / log_prob_temperature), token[:, None], 1)[:, 0]
        response = response.at[:, step].set(jnp.where(done, pad, token))
        log_probs = log_probs.at[:, step].set(jnp.where(done, 0.0, log_prob))
        done = done | jnp.isin(token, eos)
        logits, cache = decode_step(params, config, token, cache, prompt_slots + step)
        return step + 1, cache, logits, done, response, log_probs, rng

    state = (
        jnp.int32(0),
        cache,
        logits,
        jnp.zeros((batch,), bool),
        jnp.full((batch, max_new_tokens), pad, jnp.int32),
        jnp.zeros((batch, max_new_tokens), jnp.float32),
        rng,
    )
    _, _, _, _, response, log_probs, _ = jax.lax.while_loop(keep_going, body, state)

    # Response length: up to and including the first EOS.
    is_eos = jnp.isin(response, eos)
    first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, max_new_tokens)
    response_mask = jnp.arange(max_new_tokens)[None] < first_eos[:, None]
    prompts, prompt_mask = right_align_prompts(tokens, mask, pad)
    return assemble(prompts, prompt_mask.sum(axis=1).astype(jnp.int32), response, response_mask, log_probs, pad)
