"""`generate`: batched sampling with the rollout engine (`comppo_jax.rollout.engine`), in one jit.

Rows are laid out as DESIGN.md's rollouts: `prompt (P_b real tokens) + response y_1..y_T +
right padding`. Prompts may come left- or right-padded. Responses stop at the first EOS (kept,
and counted in the response) or at `max_new_tokens`. `num_samples` responses per prompt are
consecutive rows (a GRPO group).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from comppo_jax.models.config import ModelConfig
from comppo_jax.models.paged_cache import resolve_paged_attention
from comppo_jax.rollout.engine import run_engine, sample_token, top_p_filter

__all__ = ["Generation", "engine_options", "generate", "sample_token", "top_p_filter"]

DEFAULT_PAGE_SIZE = 64


class Generation(NamedTuple):
    # R = B * num_samples rows.
    tokens: Int[Array, "R P+T"]  # int32: prompt + response + right padding
    attention_mask: Bool[Array, "R P+T"]
    prompt_lengths: Int[Array, " R"]  # int32, P_b
    response_tokens: Int[Array, "R T"]  # int32, y_1..y_T (pad_token_id past the end)
    response_mask: Bool[Array, "R T"]  # 1 on y_1..y_T (EOS included)
    log_probs: Float[Array, "R T"]  # float32, log softmax(logits / temperature) of y_t; 0 on padding


def engine_options(rollout: Mapping[str, Any]) -> dict[str, Any]:
    """`generate`'s engine keywords from a config's rollout section (decode_slots 0: one slot per row).
    Configs written before the engine had these fields get the defaults."""
    return dict(
        page_size=rollout.get("page_size", DEFAULT_PAGE_SIZE),
        decode_slots=rollout.get("decode_slots", 0) or None,
        paged_attention=rollout.get("paged_attention", "auto"),
        kv_dtype=rollout.get("kv_dtype", "auto"),
    )


def check_and_default(
    config: ModelConfig,
    prompt_tokens: Int[Array, "B P"],
    prompt_mask: Bool[Array, "B P"],
    eos_token_ids: Sequence[int] | None,
    pad_token_id: int | None,
) -> tuple[Int[Array, " E"], int]:
    """Validates prompt_tokens / prompt_mask [B, P]; returns (EOS ids array, pad id) with the config's defaults."""
    if prompt_tokens.ndim != 2 or prompt_mask.shape != prompt_tokens.shape:
        raise ValueError(
            f"prompt_tokens and prompt_mask must both be [B, P], got {prompt_tokens.shape} and {prompt_mask.shape}"
        )
    eos = jnp.asarray(config.eos_token_ids if eos_token_ids is None else eos_token_ids, jnp.int32)
    pad = (config.pad_token_id or 0) if pad_token_id is None else pad_token_id
    return eos, pad


def assemble(
    prompts: Int[Array, "R P"],
    prompt_lengths: Int[Array, " R"],
    response: Int[Array, "R T"],
    response_mask: Bool[Array, "R T"],
    log_probs: Float[Array, "R T"],
    pad: int,
) -> Generation:
    """Rows as DESIGN.md lays them out, from right-padded prompts [R, P] (real tokens first), their
    lengths [R] and the response [R, T] with its mask: prompt + response + right padding."""
    prompt_width, max_new_tokens = prompts.shape[1], response.shape[1]
    response = jnp.where(response_mask, response, pad)
    width = prompt_width + max_new_tokens
    position = jnp.arange(width)[None]
    source = jnp.where(position < prompt_lengths[:, None], position, prompt_width + position - prompt_lengths[:, None])
    combined = jnp.concatenate([prompts, response], axis=1)
    combined_mask = jnp.concatenate([jnp.arange(prompt_width)[None] < prompt_lengths[:, None], response_mask], axis=1)
    inside = source < width
    source = jnp.minimum(source, width - 1)
    out_mask = inside & jnp.take_along_axis(combined_mask, source, 1)
    out_tokens = jnp.where(out_mask, jnp.take_along_axis(combined, source, 1), pad)
    return Generation(
        out_tokens, out_mask, prompt_lengths, response, response_mask, jnp.where(response_mask, log_probs, 0.0)
    )


def engine_generation(
    prompts: Int[Array, "B P"],
    prompt_lengths: Int[Array, " B"],
    response: Int[Array, "R T"],
    log_probs: Float[Array, "R T"],
    response_length: Int[Array, " R"],
    num_samples: int,
    pad: int,
) -> Generation:
    """The engine's outputs (`engine.engine_outputs`) as a Generation, each prompt repeated for its group."""
    response_mask = jnp.arange(response.shape[1])[None] < response_length[:, None]
    return assemble(
        jnp.repeat(prompts, num_samples, axis=0),
        jnp.repeat(prompt_lengths, num_samples),
        response,
        response_mask,
        log_probs,
        pad,
    )


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
        "page_size",
        "decode_slots",
        "paged_attention",
        "kv_dtype",
    ),
)
def generate(
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
    page_size: int = DEFAULT_PAGE_SIZE,
    decode_slots: int | None = None,
    paged_attention: str = "auto",
    kv_dtype: str = "auto",
) -> Generation:
    """Samples `num_samples` responses per prompt.

    prompt_tokens [B, P] int, prompt_mask [B, P] bool (either padding side); rng a PRNG key.
    temperature 0 is greedy; top_p < 1 is nucleus sampling (the paper: 1.0 / 0.7). EOS ids and
    the pad id default to the model config's. Log-probs are those of the sampled token under
    softmax(logits / temperature), before top-p truncation, which is what a teacher-forced
    scoring pass at the same temperature recomputes (greedy decoding reports temperature-1
    log-probs). Row r's tokens depend only on rng and r: `decode_slots` (rows decoded at once,
    default all), `page_size` and `paged_attention` (see `comppo_jax.models.paged_cache`) change
    speed and memory, not results. `kv_dtype` stores the KV cache's pages in another dtype ("auto":
    the compute dtype; int8 / float8_e4m3fn: 8-bit with a scale per token and kv head), and
    `params` may be the sampler's 8-bit weights (`comppo_jax.models.quantize.sampler_weights`):
    both change the log-probs a little (the learner's scoring pass measures by how much).
    """
    eos, pad = check_and_default(config, prompt_tokens, prompt_mask, eos_token_ids, pad_token_id)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts, prompt_lengths, response, log_probs, response_length = run_engine(
        params,
        config,
        prompt_tokens,
        prompt_mask,
        rng,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        page_size=page_size,
        decode_slots=decode_slots,
        temperature=temperature,
        top_p=top_p,
        eos=eos,
        pad=pad,
        backend=resolve_paged_attention(paged_attention, config.head_dim),
        kv_dtype=kv_dtype,
    )

    return engine_generation(prompts, prompt_lengths, response, log_probs, response_length, num_samples, pad)
