"""The update: actor clipped PPO + reference KL, critic clipped value regression (paper alg. 1).

Pure functions over plain pytrees; `actor_step` and `critic_step` are jitted with the model
config and recipe static. Per-step knobs from the phase controller (learning rates, clip, KL
coefficient, value clip, gradient clips) enter as traced scalars, so a phase change does not
recompile. Learning rates live in the optax state (`inject_hyperparams`), so they are
checkpointed with it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from comppo_jax.credit import entropy_from_logits, kl_penalty, masked_mean, ppo_clip_loss, value_loss
from comppo_jax.critic import Routing, standard_value_head
from comppo_jax.models import ModelConfig, forward
from comppo_jax.rollout import gather_response, token_log_probs


class Minibatch(NamedTuple):
    """Everything one gradient step reads; per-token arrays [B, T], sequence arrays [B, L]."""

    tokens: jax.Array
    attention_mask: jax.Array
    prompt_lengths: jax.Array
    response_tokens: jax.Array
    response_mask: jax.Array
    old_log_probs: jax.Array
    ref_log_probs: jax.Array
    advantages: jax.Array
    returns: jax.Array
    old_values: jax.Array
    kappa_sequence: jax.Array  # [B, L] the (control) gate at the critic's positions
    hidden_states: jax.Array  # [L', B, L, D] behaviour features the critic reads
    routing: Routing | None


def adamw(learning_rate: float) -> optax.GradientTransformation:
    """AdamW (0.9, 0.999), weight decay 0 (appendix C), with an injectable learning rate."""
    return optax.inject_hyperparams(optax.adamw)(learning_rate=learning_rate, b1=0.9, b2=0.999, weight_decay=0.0)


def _clip_and_apply(tx, params, opt_state, grads, learning_rate, max_norm):
    grad_norm = optax.global_norm(grads)
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, max_norm / (grad_norm + 1e-6)), grads)
    opt_state.hyperparams["learning_rate"] = jnp.asarray(learning_rate, jnp.float32)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grad_norm


def actor_loss(params, config: ModelConfig, batch: Minibatch, clip, kl_coef, temperature: float):
    """Clipped surrogate (eq. ppo_outer) + kl_coef * low-variance KL to the reference policy."""
    logits = forward(params, config, batch.tokens, batch.attention_mask, hidden_layers=()).logits
    log_probs = token_log_probs(logits, batch.prompt_lengths, batch.response_tokens, temperature)
    mask = batch.response_mask
    policy_loss, stats = ppo_clip_loss(log_probs, batch.old_log_probs, batch.advantages, mask, clip, clip)
    kl = kl_penalty(log_probs, batch.ref_log_probs, mask)
    entropy = masked_mean(entropy_from_logits(gather_response(logits, batch.prompt_lengths, mask.shape[1])), mask)
    metrics = {"policy_loss": policy_loss, "kl_loss": kl, "ppo_kl": stats["approx_kl"],
               "clip_fraction": stats["clip_fraction"], "entropy": jax.lax.stop_gradient(entropy)}
    return policy_loss + kl_coef * kl, metrics


@functools.partial(jax.jit, static_argnames=("config", "tx", "temperature"))
def actor_step(params, opt_state, batch: Minibatch, hyper: dict, *, config: ModelConfig, tx, temperature: float):
    """One actor update; hyper: learning_rate, clip, kl_coef, grad_clip (traced scalars)."""
    grads, metrics = jax.grad(actor_loss, has_aux=True)(params, config, batch, hyper["clip"], hyper["kl_coef"], temperature)
    params, opt_state, grad_norm = _clip_and_apply(tx, params, opt_state, grads, hyper["learning_rate"], hyper["grad_clip"])
    return params, opt_state, {**metrics, "grad_norm": grad_norm}


def critic_values(critic_params, critic_module, kind: str, batch: Minibatch):
    """V_t [B, T] at the response positions, from TAC or the standard head (both clamped)."""
    if kind == "tac":
        sequence = critic_module.apply({"params": critic_params}, batch.hidden_states, batch.routing, batch.kappa_sequence).value
    else:
        sequence = standard_value_head(critic_params, batch.hidden_states[-1])
    return gather_response(sequence, batch.prompt_lengths, batch.response_mask.shape[1])


@functools.partial(jax.jit, static_argnames=("critic_module", "kind", "tx"))
def critic_step(params, opt_state, batch: Minibatch, hyper: dict, *, critic_module, kind: str, tx):
    """One critic update toward the detached G_t; hyper: learning_rate, value_clip, grad_clip."""

    def loss(params):
        values = critic_values(params, critic_module, kind, batch)
        return value_loss(values, batch.old_values, batch.returns, batch.response_mask, hyper["value_clip"])

    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    params, opt_state, grad_norm = _clip_and_apply(tx, params, opt_state, grads, hyper["learning_rate"], hyper["grad_clip"])
    return params, opt_state, {"value_loss": value, "value_clip_fraction": stats["clip_fraction"], "critic_grad_norm": grad_norm}
