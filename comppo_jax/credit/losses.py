"""Actor and critic losses over valid tokens (paper eq. ppo_outer, sec. 4.4, alg. 1).

Aggregation is token-mean: every loss is the mean over ALL valid tokens of the
batch (verl's `loss_agg_mode="token-mean"`, as in DAPO), so long responses weigh
in proportion to their length and the loss does not depend on how rows are
padded. Per-token arrays are [B, T]; arithmetic is float32. Inputs are zeroed
on padding before use, so padding garbage (nan, inf) reaches neither the loss
nor its gradient. Rollout-side inputs (old/reference log-probs, advantages,
old values, returns) are wrapped in `stop_gradient`: they are data, never
optimized through.
"""

import functools

import jax
import jax.numpy as jnp

from comppo_jax.credit import _validation

# Bound on |log ratio| before exp, as verl: keeps exp finite for tokens whose
# log-probs disagree wildly (clipping makes their gradient zero anyway).
_MAX_LOG_RATIO = 20.0
_KL_KINDS = ("k1", "k3", "low_var_kl")


def _valid(x, mask):
    """x as float32 with padding replaced by 0."""
    return jnp.where(mask.astype(bool), x.astype(jnp.float32), 0.0)


@jax.jit
def masked_mean(x, mask):
    """Token-mean of `x` over the valid tokens of the whole batch.

    Padding is excluded with `where`, so non-finite padding values cannot leak.
    Returns 0 when the mask is empty.
    """
    _validation.check_bt(x=x, mask=mask)
    count = jnp.sum(mask.astype(bool), dtype=jnp.float32)
    return jnp.sum(_valid(x, mask)) / jnp.maximum(count, 1.0)


@jax.jit
def ppo_clip_loss(log_probs, old_log_probs, advantages, mask, clip_low=0.2, clip_high=0.2):
    """Clipped PPO surrogate, paper eq. (ppo_outer), as a loss to minimize.

        ratio = exp(logp - old_logp)
        loss  = token-mean( -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) )

    Args:
      log_probs: [B, T] float, log pi_theta(y_t | h_t) (differentiated).
      old_log_probs: [B, T] float, behaviour-policy log-probs.
      advantages: [B, T] float, normalized advantages.
      mask: [B, T] mask of valid tokens.
      clip_low, clip_high: ratio clip range (asymmetric allowed, as DAPO).

    Returns:
      (loss, metrics): scalar loss and a dict of scalars
        "clip_fraction": fraction of valid tokens where the clipped branch is
          the active one (their gradient is zero);
        "approx_kl": k1 estimate of KL(old || new), token-mean of
          old_logp - logp (verl's `ppo_kl`).
    """
    _validation.check_bt(log_probs=log_probs, old_log_probs=old_log_probs,
                         advantages=advantages, mask=mask)
    logp = _valid(log_probs, mask)
    old_logp = jax.lax.stop_gradient(_valid(old_log_probs, mask))
    adv = jax.lax.stop_gradient(_valid(advantages, mask))
    log_ratio = jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = masked_mean(jnp.maximum(unclipped, clipped), mask)
    metrics = {
        "clip_fraction": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "approx_kl": jax.lax.stop_gradient(masked_mean(old_logp - logp, mask)),
    }
    return loss, metrics


@functools.partial(jax.jit, static_argnames=("kind",))
def kl_penalty(log_probs, ref_log_probs, mask, kind="low_var_kl"):
    """Reference-policy KL penalty, token-mean over valid tokens (paper alg. 1).

    kind="k1":  logp - ref_logp.
    kind="low_var_kl" (alias "k3"), as verl: with d = ref_logp - logp clamped
      to [-20, 20], kl = exp(d) - d - 1, clamped to [-10, 10]. Unbiased for
      KL(pi || ref) before clamping, lower variance than k1. Computed as
      expm1(d) - d, which keeps it non-negative in float32 where exp(d) - d - 1
      rounds below zero for |d| near 1e-7.

    Args:
      log_probs: [B, T] float, current-policy log-probs (differentiated).
      ref_log_probs: [B, T] float, reference-policy log-probs.
      mask: [B, T] mask of valid tokens.
      kind: "k1", "k3" or "low_var_kl" (static).

    Returns:
      Scalar penalty (multiply by the KL coefficient and add to the loss).
    """
    _validation.check_bt(log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask)
    if kind not in _KL_KINDS:
        raise ValueError(f"kind must be one of {_KL_KINDS}, got {kind!r}")
    logp = _valid(log_probs, mask)
    ref = jax.lax.stop_gradient(_valid(ref_log_probs, mask))
    if kind == "k1":
        per_token = logp - ref
    else:
        d = jnp.clip(ref - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        per_token = jnp.clip(jnp.expm1(d) - d, -10.0, 10.0)
    return masked_mean(per_token, mask)


@jax.jit
def value_loss(values, old_values, returns, mask, clip=0.5):
    """Clipped value loss (paper sec. 4.4; value-loss clip 0.5 in the stable phase).

        v_clip = old_v + clip(v - old_v, -clip, clip)
        loss   = token-mean( 0.5 * max((v - G)^2, (v_clip - G)^2) )

    Args:
      values: [B, T] float, current critic values (differentiated).
      old_values: [B, T] float, critic values at rollout time.
      returns: [B, T] float, detached targets G_t from `comp_gae`.
      mask: [B, T] mask of valid tokens.
      clip: value-loss clip range.

    Returns:
      (loss, metrics): scalar loss and {"clip_fraction": fraction of valid
      tokens where the clipped term is the larger one}.
    """
    _validation.check_bt(values=values, old_values=old_values, returns=returns, mask=mask)
    v = _valid(values, mask)
    old_v = jax.lax.stop_gradient(_valid(old_values, mask))
    target = jax.lax.stop_gradient(_valid(returns, mask))
    v_clipped = old_v + jnp.clip(v - old_v, -clip, clip)
    unclipped = (v - target) ** 2
    clipped = (v_clipped - target) ** 2
    loss = 0.5 * masked_mean(jnp.maximum(unclipped, clipped), mask)
    metrics = {"clip_fraction": masked_mean((clipped > unclipped).astype(jnp.float32), mask)}
    return loss, metrics


@jax.jit
def entropy_from_logits(logits):
    """Per-token entropy of softmax(logits): logsumexp(z) - sum softmax(z) z.

    Aggregate with `masked_mean(entropy_from_logits(logits), mask)`.

    Args:
      logits: [B, T, V] float.

    Returns:
      [B, T] float32 entropies.
    """
    _validation.check_rank("logits", logits, 3, "[B, T, V]")
    _validation.check_floating("logits", logits)
    z = logits.astype(jnp.float32)
    # -inf logits (masked vocabulary) would give 0 * -inf = nan; the most negative
    # finite float gives probability 0 and a zero contribution instead.
    z = jnp.where(jnp.isneginf(z), jnp.finfo(jnp.float32).min, z)
    log_z = jax.nn.logsumexp(z, axis=-1)
    probs = jax.nn.softmax(z, axis=-1)
    return log_z - jnp.sum(probs * z, axis=-1)
