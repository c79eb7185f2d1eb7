"""The behaviour-policy scoring pass: one teacher-forced forward over prompt + response.

Per response token y_t everything is read at the state before it, sequence position
p_t = P + t - 2 (0-based: P - 1 + (t - 1)), so per-token arrays are the slice [P-1, P+T-1) of
the sequence (../shared/DESIGN.md, index conventions). The pass yields the behaviour log-probs,
the final layer's concentration H_t -> c_t -> kappa_t (paper eqs. herfindahl, cnorm,
kappa_attention; the concentration kernel), the hidden states and top-K routing the TAC critic
reuses, and the reference policy's log-probs. Everything is detached and stored with the
rollout: kappa is fixed for all update epochs of the batch (paper section 3).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from comppo_jax.credit import normalized_concentration, retention_gate
from comppo_jax.critic import Routing, window_topk
from comppo_jax.models import ModelConfig, forward
from comppo_jax.rollout.sampler import Generation

WINDOWS = ("response", "full")


class Rollout(NamedTuple):
    """A scored batch. Per-token arrays are [B, T], aligned with y_1..y_T, 0 on padding."""

    tokens: jax.Array  # [B, L] int32, prompt + response + right padding
    attention_mask: jax.Array  # [B, L] bool
    prompt_lengths: jax.Array  # [B] int32
    response_mask: jax.Array  # [B, T] bool
    log_probs: jax.Array  # [B, T] behaviour log pi(y_t | h_t), teacher-forced
    ref_log_probs: jax.Array | None  # [B, T] reference policy, or None without one
    herfindahl: jax.Array  # [B, T] H_t of the final layer over the window
    window_size: jax.Array  # [B, T] int32 n_t
    kappa: jax.Array  # [B, T] retention gate kappa_t
    hidden_states: jax.Array  # [L', B, L, D] the critic's fused layers (sequence coordinates)
    routing: Routing | None  # TAC's top-K native-attention routing [B, L, K], or None


def response_positions(prompt_lengths, length: int):
    """[B, T] sequence positions p_t = P - 1 + (t - 1) of the states before y_1..y_T."""
    return prompt_lengths[:, None] - 1 + jnp.arange(length)[None]


def gather_response(x, prompt_lengths, length: int):
    """x [B, L, ...] -> [B, T, ...] at the positions before each response token."""
    positions = jnp.clip(response_positions(prompt_lengths, length), 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, positions.reshape(positions.shape + (1,) * (x.ndim - 2)), axis=1)


def token_log_probs(logits, prompt_lengths, response_tokens, temperature: float = 1.0):
    """log softmax(logits / temperature) of y_t, read at p_t; logits [B, L, V] -> [B, T] float32."""
    response_logits = gather_response(logits, prompt_lengths, response_tokens.shape[1]).astype(jnp.float32) / temperature
    taken = jnp.take_along_axis(response_logits, response_tokens[..., None], axis=-1)[..., 0]
    return taken - jax.nn.logsumexp(response_logits, axis=-1)


@functools.partial(
    jax.jit,
    static_argnames=("config", "window", "temperature", "hidden_layers", "top_k", "kappa_lo", "kappa_hi", "tau", "backend"),
)
def score_rollout(
    params: dict,
    ref_params: dict | None,
    config: ModelConfig,
    generation: Generation,
    *,
    window: str = "response",
    temperature: float = 1.0,
    hidden_layers: tuple[int, ...] = (),
    top_k: int | None = 64,
    kappa_lo: float = 0.1,
    kappa_hi: float = 0.9,
    tau: float = 4.0,
    backend: str | None = None,
) -> Rollout:
    """Scores a generation with the behaviour policy `params` (and `ref_params`, if given).

    window: "response" (the paper's: keys in [P, p_t]) or "full" (every real key in [0, p_t]).
    hidden_layers: HF hidden-state indices the critic fuses (`fused_hidden_layers`).
    top_k: TAC's routed positions per token, or None for no routing (standard critic).
    (kappa_lo, kappa_hi, tau): the gate envelope of eq. kappa_attention.
    """
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    mask = generation.attention_mask
    window_start = generation.prompt_lengths if window == "response" else jnp.zeros_like(generation.prompt_lengths)
    out = forward(
        params, config, generation.tokens, mask, window_start, hidden_layers=hidden_layers,
        concentration_backend=backend, return_final_attention=top_k is not None,
    )
    length = generation.response_tokens.shape[1]
    response_mask = generation.response_mask
    log_probs = token_log_probs(out.logits, generation.prompt_lengths, generation.response_tokens, temperature)
    herfindahl = gather_response(out.herfindahl, generation.prompt_lengths, length)
    window_size = gather_response(out.window_size, generation.prompt_lengths, length)
    kappa = retention_gate(normalized_concentration(herfindahl, window_size), kappa_lo=kappa_lo, kappa_hi=kappa_hi, tau=tau)
    ref_log_probs = None
    if ref_params is not None:
        ref_logits = forward(ref_params, config, generation.tokens, mask, hidden_layers=()).logits
        ref_log_probs = jnp.where(response_mask, token_log_probs(ref_logits, generation.prompt_lengths, generation.response_tokens, temperature), 0.0)
    routing = None
    if top_k is not None:
        routing = window_topk(*out.final_attention, mask, window_start, top_k=top_k)
    zero = lambda x: jnp.where(response_mask, x, jnp.zeros((), x.dtype))
    return jax.lax.stop_gradient(Rollout(
        generation.tokens, mask, generation.prompt_lengths, response_mask, zero(log_probs), ref_log_probs,
        zero(herfindahl), zero(window_size), zero(kappa), out.hidden_states, routing,
    ))
