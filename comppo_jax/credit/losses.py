"""Actor and critic losses over valid tokens (paper eq. ppo_outer, sec. 4.4, alg. 1).

Aggregation is token-mean unless stated: every loss is the mean over ALL valid
tokens of the batch (verl's `loss_agg_mode="token-mean"`, as in DAPO), so long
responses weigh in proportion to their length and the loss does not depend on
how rows are padded. `aggregate_loss` provides verl's other modes (GSPO's
sequence mean, Dr.GRPO's constant normalizer) and tunix's token scale. Per-token arrays are [B, T];
arithmetic is float32. Inputs are zeroed on padding before use, so padding
garbage (nan, inf) reaches neither the loss nor its gradient. Rollout-side
inputs (old/reference log-probs, advantages, old values, returns) are wrapped
in `stop_gradient`: they are data, never optimized through.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from comppo_jax.credit import _validation

# Bound on |log ratio| before exp, as verl: keeps exp finite for tokens whose
# log-probs disagree wildly (clipping makes their gradient zero anyway).
_MAX_LOG_RATIO = 20.0
_KL_KINDS = ("k1", "k3", "low_var_kl")
# Upper bound on GSPO's sequence log ratio before exp, as verl and tunix
# (one-sided: a very negative mean only sends the ratio to 0).
_MAX_SEQ_LOG_RATIO = 10.0
# verl's `loss_agg_mode` names, and tunix's "sequence-mean-token-scale" (Dr.GRPO's own normalization)
# as "seq-mean-token-scale": the modes of `aggregate_loss`.
LOSS_AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-scale",
)
# `decoupled_ppo_inputs`' rules for a behaviour importance weight over the cap: AReaL's, then truncated IS.
IMPORTANCE_WEIGHT_RULES = ("mask", "truncate")


def _valid(x: Float[Array, "B T"], mask: Shaped[Array, "B T"]) -> Float[Array, "B T"]:
    """x as float32 with padding replaced by 0."""
    return jnp.where(mask.astype(bool), x.astype(jnp.float32), 0.0)


@jax.jit
def masked_mean(x: Float[Array, "B T"], mask: Shaped[Array, "B T"]) -> Float[Array, ""]:
    """Token-mean of `x` over the valid tokens of the whole batch.

    Padding is excluded with `where`, so non-finite padding values cannot leak.
    Returns 0 when the mask is empty.
    """
    _validation.check_bt(x=x, mask=mask)
    count = jnp.sum(mask.astype(bool), dtype=jnp.float32)
    return jnp.sum(_valid(x, mask)) / jnp.maximum(count, 1.0)


@functools.partial(jax.jit, static_argnames=("mode",))
def aggregate_loss(
    per_token: Float[Array, "B T"], mask: Shaped[Array, "B T"], mode: str, norm_length: float | None = None
) -> Float[Array, ""]:
    """Reduces a [B, T] per-token loss to a scalar, as verl's `agg_loss`.

    With n_i the valid-token count of row i and S the rows with n_i > 0:

      "token-mean":              sum_{i,t} x / sum_i n_i (`masked_mean`).
      "seq-mean-token-mean":     mean_{i in S} (sum_t x_{i,t} / n_i) (GSPO).
      "seq-mean-token-sum":      mean_{i in S} sum_t x_{i,t}.
      "seq-mean-token-sum-norm": sum_{i,t} x / norm_length, verl's form of
        Dr.GRPO's constant normalizer: a sum over rows, not a mean (tunix's
        "sequence-mean-token-sum-norm" with norm=norm_length). |S| times
        "seq-mean-token-scale".
      "seq-mean-token-scale":    mean_{i in S} (sum_t x_{i,t} / norm_length),
        Dr.GRPO's own normalization (Liu et al. 2025; the authors' oat code,
        masked_sum with constant_normalizer=generate_max_length, then a mean
        over rows) and tunix's "sequence-mean-token-scale".

    verl (core_algos.agg_loss) is followed with dp_size=1 and its batch-size
    and token-count overrides unset, except that an empty mask gives 0 (verl
    divides by zero) and n_i is not offset by verl's 1e-8.

    Args:
      per_token: [B, T] float.
      mask: [B, T] mask of valid tokens.
      mode: one of the four names above (static).
      norm_length: the constant of "seq-mean-token-sum-norm" and
        "seq-mean-token-scale" (verl's `loss_scale_factor`, e.g. the maximum
        response length); None means T, verl's default. Ignored by the other
        modes.

    Returns:
      Scalar float32.
    """
    _validation.check_bt(per_token=per_token, mask=mask)
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"mode must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    row_sums = jnp.sum(_valid(per_token, mask), axis=1)
    norm = jnp.asarray(per_token.shape[1] if norm_length is None else norm_length, jnp.float32)
    if mode == "seq-mean-token-sum-norm":
        return jnp.sum(row_sums) / norm
    lengths = jnp.sum(mask.astype(bool), axis=1, dtype=jnp.float32)
    if mode == "seq-mean-token-mean":
        row_sums = row_sums / jnp.maximum(lengths, 1.0)
    if mode == "seq-mean-token-scale":
        row_sums = row_sums / norm
    rows = jnp.sum(lengths > 0, dtype=jnp.float32)
    return jnp.sum(row_sums) / jnp.maximum(rows, 1.0)


def _surrogate_inputs(
    log_probs: Float[Array, "B T"],
    old_log_probs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
) -> tuple[Float[Array, "B T"], Float[Array, "B T"], Float[Array, "B T"]]:
    """Shape-checked float32 (logp, old_logp, advantages), padding zeroed; the rollout's detached."""
    _validation.check_bt(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, mask=mask)
    logp = _valid(log_probs, mask)
    old_logp = jax.lax.stop_gradient(_valid(old_log_probs, mask))
    adv = jax.lax.stop_gradient(_valid(advantages, mask))
    return logp, old_logp, adv


def _clipped_surrogate(
    log_ratio: Float[Array, "B T"],
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    adv: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    clip_low: float,
    clip_high: float,
    aggregation: str,
    norm_length: float | None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Aggregated max(-ratio A, -clip(ratio) A) with the token-mean metrics of
    verl's `pg_clipfrac` and `ppo_kl`, whatever the aggregation, and the part of
    the clip fraction at the upper bound (A > 0, ratio > 1 + clip_high)."""
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = aggregate_loss(jnp.maximum(unclipped, clipped), mask, aggregation, norm_length)
    metrics = {
        "clip_fraction": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "clip_fraction_high": masked_mean(((clipped > unclipped) & (adv > 0)).astype(jnp.float32), mask),
        "approx_kl": jax.lax.stop_gradient(masked_mean(old_logp - logp, mask)),
    }
    return loss, metrics


@functools.partial(jax.jit, static_argnames=("aggregation",))
def ppo_clip_loss(
    log_probs: Float[Array, "B T"],
    old_log_probs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token-mean",
    norm_length: float | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Clipped PPO surrogate, paper eq. (ppo_outer), as a loss to minimize.

        ratio = exp(logp - old_logp)
        loss  = token-mean( -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) )

    with token-mean replaced by `aggregation` when given.

    Args:
      log_probs: [B, T] float, log pi_theta(y_t | h_t) (differentiated).
      old_log_probs: [B, T] float, behaviour-policy log-probs.
      advantages: [B, T] float, normalized advantages.
      mask: [B, T] mask of valid tokens.
      clip_low, clip_high: ratio clip range (asymmetric allowed, as DAPO).
      aggregation: how the per-token losses are reduced, an `aggregate_loss`
        mode (static); "seq-mean-token-sum-norm" with advantages from
        `grpo_advantages(..., normalize_std=False)` is Dr.GRPO.
      norm_length: `aggregate_loss`'s constant for "seq-mean-token-sum-norm".

    Returns:
      (loss, metrics): scalar loss and a dict of scalars
        "clip_fraction": fraction of valid tokens where the clipped branch is
          the active one (their gradient is zero);
        "clip_fraction_high": the part of it at the upper bound (A > 0);
        "approx_kl": k1 estimate of KL(old || new), token-mean of
          old_logp - logp (verl's `ppo_kl`).
    """
    logp, old_logp, adv = _surrogate_inputs(log_probs, old_log_probs, advantages, mask)
    log_ratio = jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _clipped_surrogate(log_ratio, logp, old_logp, adv, mask, clip_low, clip_high, aggregation, norm_length)


def decoupled_ppo_inputs(
    behaviour_log_probs: Float[Array, "B T"],
    proximal_log_probs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    cap: float = 5.0,
    rule: str = "mask",
) -> tuple[Float[Array, "B T"], Float[Array, "B T"], Float[Array, "B T"], Float[Array, "B T"]]:
    """AReaL's decoupled PPO objective (Fu et al. 2025, eq. 5) for a batch generated by an older
    (behaviour) policy, as the inputs of the clipped surrogate:

        w_t  = pi_prox(y_t) / pi_behav(y_t)                   (behaviour importance weight)
        c_t  = w_t if w_t <= cap else 0     (rule "mask")     or   min(w_t, cap)   (rule "truncate")
        u_t  = pi_theta(y_t) / pi_prox(y_t)
        loss = token-mean( -c_t min(u_t A_t, clip(u_t, 1 - eps, 1 + eps) A_t) )

    "mask" is AReaL's `behav_imp_weight_cap` (realhf `actor_loss_fn`, areal `ppo_actor_loss_fn`):
    a token whose weight exceeds the cap is dropped from the loss (its weight set to 0) while the
    token-mean still divides by every valid token, as AReaL's `loss_mask_count`. "truncate" is
    truncated importance sampling, this module's earlier rule. As c_t >= 0 factors out of the min,
    the loss is `ppo_clip_loss(log_probs, proximal_log_probs, c * A)`: the ratio is clipped against
    the proximal policy (recomputed with the current params before the update) and the advantages
    carry the importance weight.

    Args:
      behaviour_log_probs, proximal_log_probs: [B, T] log-probs of the sampled tokens under the
        policy that generated them and under the proximal policy.
      advantages: [B, T]; mask: [B, T] valid tokens; cap: the cap (> 0); rule: "mask" | "truncate".

    Returns:
      (old_log_probs for the ratio: the proximal log-probs, advantages c * A, w and c [B, T], 0 on
      padding; a non-finite w stays non-finite in c).
    """
    _validation.check_bt(
        behaviour_log_probs=behaviour_log_probs, proximal_log_probs=proximal_log_probs, advantages=advantages, mask=mask
    )
    if rule not in IMPORTANCE_WEIGHT_RULES:
        raise ValueError(f"rule={rule!r}: expected one of {IMPORTANCE_WEIGHT_RULES}")
    log_weight = jnp.clip(
        _valid(proximal_log_probs, mask) - _valid(behaviour_log_probs, mask), -_MAX_LOG_RATIO, _MAX_LOG_RATIO
    )
    weights = _valid(jnp.exp(log_weight), mask)
    # `weights > cap` rather than `<= cap`: a NaN weight stays NaN, for the learner's finiteness guard.
    capped = jnp.where(weights > cap, 0.0, weights) if rule == "mask" else jnp.minimum(weights, cap)
    return proximal_log_probs, advantages * capped, weights, capped


@functools.partial(jax.jit, static_argnames=("token_level", "aggregation"))
def gspo_loss(
    log_probs: Float[Array, "B T"],
    old_log_probs: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    clip_low: float,
    clip_high: float,
    token_level: bool = False,
    aggregation: str = "seq-mean-token-mean",
    norm_length: float | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """GSPO clipped surrogate (Zheng et al. 2025), as a loss to minimize.

    The importance ratio is the length-normalized sequence ratio, clipped as a
    whole (the paper uses clip_low = 3e-4, clip_high = 4e-4):

        log s_i = min(mean_{t valid} (logp_{i,t} - old_logp_{i,t}), 10)
        loss    = seq-mean-token-mean( -min(s A, clip(s, 1 - clip_low, 1 + clip_high) A) )

    token_level=False (GSPO): s_{i,t} = s_i, so every token's gradient flows
    through s_i into all tokens of its row.
    token_level=True (GSPO-token): s_{i,t} = sg(s_i) pi(y_t) / sg(pi(y_t)), i.e.
    log s_{i,t} = min(logp - sg(logp) + sg(log s_i), 10): the value of s_i with
    the gradient of a per-token ratio, d s_{i,t} / d logp_{i,t} = s_i. With
    advantages constant along a row both give the same loss and gradient.

    GSPO-token with the defaults is verl core_algos.compute_policy_loss_gspo
    (its only form: one-sided clamp at 10 of the combined log ratio, no clamp of
    the per-token log ratios, "seq-mean-token-mean" whatever `loss_agg_mode`)
    and tunix algo_core.grpo_loss_fn with loss_algo="gspo-token" and its default
    "sequence-mean-token-mean", except that tunix first clips each token's log
    ratio to [-20, 20].

    Args:
      log_probs: [B, T] float, log pi_theta(y_t | h_t) (differentiated).
      old_log_probs: [B, T] float, behaviour-policy log-probs.
      advantages: [B, T] float, e.g. GRPO advantages broadcast over the row.
      mask: [B, T] mask of valid tokens.
      clip_low, clip_high: clip range of the sequence ratio.
      token_level: GSPO-token instead of GSPO (static).
      aggregation, norm_length: as in `ppo_clip_loss`, GSPO's default.

    Returns:
      (loss, metrics) as `ppo_clip_loss`: "clip_fraction" counts valid tokens
      whose clipped branch is active, "approx_kl" is the per-token k1 estimate.
    """
    logp, old_logp, adv = _surrogate_inputs(log_probs, old_log_probs, advantages, mask)
    lengths = jnp.sum(mask.astype(bool), axis=1, keepdims=True, dtype=jnp.float32)
    seq_log_ratio = jnp.sum(logp - old_logp, axis=1, keepdims=True) / jnp.maximum(lengths, 1.0)
    if token_level:
        seq_log_ratio = logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq_log_ratio)
    log_ratio = jnp.minimum(seq_log_ratio, _MAX_SEQ_LOG_RATIO)
    log_ratio = jnp.broadcast_to(log_ratio, logp.shape)
    return _clipped_surrogate(log_ratio, logp, old_logp, adv, mask, clip_low, clip_high, aggregation, norm_length)


@functools.partial(jax.jit, static_argnames=("kind", "aggregation"))
def kl_penalty(
    log_probs: Float[Array, "B T"],
    ref_log_probs: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    kind: str = "low_var_kl",
    aggregation: str = "token-mean",
    norm_length: float | None = None,
) -> Float[Array, ""]:
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
      aggregation, norm_length: `aggregate_loss`'s mode (static) and constant;
        verl aggregates the KL with the policy loss's mode.

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
    return aggregate_loss(per_token, mask, aggregation, norm_length)


@jax.jit
def value_loss(
    values: Float[Array, "B T"],
    old_values: Float[Array, "B T"],
    returns: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    clip: float = 0.5,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
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
def entropy_from_logits(logits: Float[Array, "B T V"]) -> Float[Array, "B T"]:
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
