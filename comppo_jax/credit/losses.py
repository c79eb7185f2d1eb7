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
from fractions import Fraction

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Shaped

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
# `rollout_correction`'s rules (train.rollout_correction): no weights, truncated or masked importance sampling; and
# the levels the ratio is taken at.
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence", "geometric")


def _valid(x: Float[Array, "B T"], mask: Shaped[Array, "B T"]) -> Float[Array, "B T"]:
    """x as float32 with padding replaced by 0."""
    return jnp.where(mask.astype(bool), x.astype(jnp.float32), 0.0)


def _row_mean(x: Float[Array, "B T"], mask: Shaped[Array, "B T"]) -> Float[Array, "B 1"]:
    """Each row's mean of `x` over its valid tokens (0 for a row without any); `x` zero on padding."""
    lengths = jnp.sum(mask.astype(bool), axis=1, keepdims=True, dtype=jnp.float32)
    return jnp.sum(x, axis=1, keepdims=True) / jnp.maximum(lengths, 1.0)


def _log_ratio(
    log_numerator: Float[Array, "B T"], log_denominator: Float[Array, "B T"], mask: Shaped[Array, "B T"]
) -> Float[Array, "B T"]:
    """log(p_num / p_den) per token, clipped to +-_MAX_LOG_RATIO, 0 on padding; a NaN stays NaN."""
    return jnp.clip(_valid(log_numerator, mask) - _valid(log_denominator, mask), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _capped(weights: Float[Array, "B T"], cap: float, drop: bool, lower: float = 0.0) -> Float[Array, "B T"]:
    """Importance weights over `cap` (or, with `drop`, under `lower`) set to 0 (`drop`: the token leaves the loss)
    or to `cap` (truncated). `weights > cap` rather than `<= cap`: a NaN weight stays NaN, for the learner's
    finiteness guard."""
    return jnp.where((weights > cap) | (weights < lower), 0.0, weights) if drop else jnp.minimum(weights, cap)


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
    weights = _valid(jnp.exp(_log_ratio(proximal_log_probs, behaviour_log_probs, mask)), mask)
    capped = _capped(weights, cap, drop=rule == "mask")
    return proximal_log_probs, advantages * capped, weights, capped


@jax.jit
def sampler_mismatch(
    sampler_log_probs: Float[Array, "B T"], score_log_probs: Float[Array, "B T"], mask: Shaped[Array, "B T"]
) -> dict[str, Float[Array, ""]]:
    """How far the sampler's distribution pi_sample (which drew the tokens, e.g. with an 8-bit KV cache or
    weights) lies from the scorer's pi_score (the same policy teacher-forced in the learner's precision),
    on the sampled tokens (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"). With r_t = pi_score(y_t) / pi_sample(y_t) over the valid tokens, y_t ~ pi_sample:

        kl                        = token-mean( r - 1 - log r )      k3 estimate of KL(pi_sample || pi_score)
        abs_log_ratio_mean        = token-mean( |log r| )
        abs_log_ratio_max         = max( |log r| )
        ratio_outside_half_to_two = token-mean( r < 1/2 or r > 2 )

    k3 is unbiased (E_sample[r] = 1) and non-negative per token; it is computed as expm1(log r) - log r,
    which stays >= 0 in float32 (as `kl_penalty`). log r is clipped to +-20 first, as the PPO ratio's.

    Args:
      sampler_log_probs: [B, T] log pi_sample(y_t), as the sampler recorded them.
      score_log_probs: [B, T] log pi_score(y_t), the scoring pass's.
      mask: [B, T] valid tokens.

    Returns:
      The four scalars by name (float32; 0 when the mask is empty; NaN where a log-prob is).
    """
    _validation.check_bt(sampler_log_probs=sampler_log_probs, score_log_probs=score_log_probs, mask=mask)
    log_ratio = _log_ratio(score_log_probs, sampler_log_probs, mask)
    magnitude = jnp.abs(log_ratio)
    return {
        "kl": masked_mean(jnp.expm1(log_ratio) - log_ratio, mask),
        "abs_log_ratio_mean": masked_mean(magnitude, mask),
        "abs_log_ratio_max": jnp.max(magnitude, initial=0.0),
        "ratio_outside_half_to_two": masked_mean((magnitude > jnp.log(2.0)).astype(jnp.float32), mask),
    }


def rollout_correction_weights(
    sampler_log_probs: Float[Array, "B T"],
    score_log_probs: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    rule: str = "tis",
    cap: float = 2.0,
    level: str = "token",
    lower_cap: float = 0.0,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Importance weights from the sampler's distribution to the scorer's, which correct the policy
    gradient for tokens drawn by pi_sample but scored (and the PPO ratio taken) under pi_score (Yao et
    al. 2025, see `sampler_mismatch`). With r_t = pi_score(y_t) / pi_sample(y_t), the cap C > 1 and the lower
    cap C_lo (`lower_cap`; 0 takes 1 / C), as verl's rollout correction names them:

        level "token":      rho_t = r_t
        level "sequence":   rho_t = rho_i = exp( clip( sum_{t valid in response i} log r_t, -20, 20 ) )
        level "geometric":  rho_t = rho_i = exp( mean_{t valid in response i} log r_t )
        rule "tis":         c_t = min(rho_t, C)                               (truncated importance sampling)
        rule "mis":         c_t = rho_t if C_lo <= rho_t <= C else 0           (masked importance sampling)
        loss                = token-mean( -c_t min(u_t A_t, clip(u_t, 1 - eps, 1 + eps) A_t) )

    so, as c_t >= 0 factors out of the min, the weights multiply the advantages of any clipped surrogate
    (`ppo_clip_loss`, `gspo_loss`), as `decoupled_ppo_inputs`' do. "sequence" is the sequence-level
    importance weight, the product of its tokens' ratios (over thousands of tokens it puts most responses
    past any cap); "geometric" its length-normalized form (GSPO's), which stays near 1. Under "mis" a token
    (or a whole response) outside [C_lo, C] leaves the loss, as verl's rejection sampling rejects it, but the
    token-mean still divides by every valid token (AReaL's mask), where verl drops rejected tokens from the
    response mask and so from the denominator: a batch with many rejected tokens takes a smaller step here.
    log r_t is clipped to +-20 before exp, as the PPO ratio's.

    Args:
      sampler_log_probs: [B, T] log pi_sample(y_t), as the sampler recorded them.
      score_log_probs: [B, T] log pi_score(y_t), the scoring pass's (the PPO ratio's old log-probs).
      mask: [B, T] valid tokens.
      rule: "tis" | "mis"; cap: C (> 1); level: "token" | "sequence" | "geometric"; lower_cap: C_lo in
        [0, 1) for "mis" (0: 1 / C).

    Returns:
      (rho, c) [B, T] float32, 0 on padding; a non-finite rho stays non-finite in c (the learner's
      finiteness guard sees it), at a response level for every token of its response.
    """
    _validation.check_bt(sampler_log_probs=sampler_log_probs, score_log_probs=score_log_probs, mask=mask)
    if rule not in ROLLOUT_CORRECTIONS[1:]:
        raise ValueError(f"rule={rule!r}: expected one of {ROLLOUT_CORRECTIONS[1:]}")
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(f"level={level!r}: expected one of {ROLLOUT_CORRECTION_LEVELS}")
    if not cap > 1.0:
        raise ValueError(f"cap={cap}: must be > 1 (every weight would be capped below the on-policy 1)")
    if not 0.0 <= lower_cap < 1.0:
        raise ValueError(f"lower_cap={lower_cap}: must be in [0, 1) (0: 1 / cap)")
    log_ratio = _log_ratio(score_log_probs, sampler_log_probs, mask)
    if level == "sequence":
        total = jnp.clip(jnp.sum(log_ratio, axis=1, keepdims=True), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        log_ratio = jnp.broadcast_to(total, log_ratio.shape)
    elif level == "geometric":
        log_ratio = jnp.broadcast_to(_row_mean(log_ratio, mask), log_ratio.shape)
    ratios = _valid(jnp.exp(log_ratio), mask)
    return ratios, _capped(ratios, cap, drop=rule == "mis", lower=mis_lower_cap(lower_cap, cap))


def mis_lower_cap(lower_cap: float, cap: float) -> float:
    """The lower cap C_lo a "mis" rollout correction rejects under: `lower_cap`, or 1 / `cap` for 0 (verl's)."""
    return lower_cap or 1.0 / cap


def importance_weight_stats(
    weights: Float[Array, "B T"], mask: Shaped[Array, "B T"], cap: float, lower: float = 0.0
) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    """Importance weights' token-mean, max and fraction outside [`lower`, `cap`], over the valid tokens, before
    the cap (weights >= 0, 0 on padding; 0, 0, 0 for an empty mask). Traced where the weights are computed: a
    host read of a batch split across processes would see each process's own rows only."""
    outside = jnp.float32((weights > cap) | (weights < lower))
    return masked_mean(weights, mask), jnp.max(weights, initial=0.0), masked_mean(outside, mask)


def rollout_correction(
    sampler_log_probs: Float[Array, "B T"],
    score_log_probs: Float[Array, "B T"],
    mask: Shaped[Array, "B T"],
    rule: str = "none",
    cap: float = 2.0,
    level: str = "token",
    lower_cap: float = 0.0,
) -> tuple[Float[Array, "B T"] | None, dict[str, Float[Array, ""]]]:
    """The learner's rollout correction (train.rollout_correction = `rule`): the weights c of
    `rollout_correction_weights` (None for rule "none"), and the metrics: `sampler_mismatch`'s as
    mismatch/kl, /abs_log_ratio_mean, /abs_log_ratio_max, /ratio_outside_half_to_two, whatever the rule,
    and with weights rollout_correction/weight_mean, /weight_max (rho before the cap) and
    /truncated_fraction (tis: rho over the cap) or /masked_fraction (mis: rho outside [lower cap, cap])."""
    metrics = {f"mismatch/{name}": x for name, x in sampler_mismatch(sampler_log_probs, score_log_probs, mask).items()}
    if rule == "none":
        return None, metrics
    ratios, weights = rollout_correction_weights(sampler_log_probs, score_log_probs, mask, rule, cap, level, lower_cap)
    lower = mis_lower_cap(lower_cap, cap) if rule == "mis" else 0.0
    mean, largest, over = importance_weight_stats(ratios, mask, cap, lower)
    dropped = "masked" if rule == "mis" else "truncated"
    names = ("weight_mean", "weight_max", f"{dropped}_fraction")
    return weights, {**metrics, **{f"rollout_correction/{name}": x for name, x in zip(names, (mean, largest, over))}}


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
    seq_log_ratio = _row_mean(logp - old_logp, mask)
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


# Largest denominator of the kept fraction read as an exact ratio p / q (`entropy_top_mask`): ceil(n p / q) is then
# computed in int32 without overflow for any token count n, and without float rounding adding or losing a token.
_MAX_FRACTION_DENOMINATOR = 10_000


@functools.partial(jax.jit, static_argnames=("fraction",))
def entropy_top_mask(
    entropy: Float[Array, "B T"], mask: Shaped[Array, "B T"], fraction: float = 0.2
) -> tuple[Bool[Array, "B T"], Float[Array, ""]]:
    """The high-entropy "forking" tokens, the only ones whose policy gradient counts in Wang et al. 2025 ("Beyond
    the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning",
    arXiv 2506.01939: the objective J_HighEnt, DAPO's with the indicator I[H_t >= tau_rho]). Of the n valid
    tokens of the whole [B, T] set, with rho = `fraction`:

        k    = max(1, ceil(rho n))
        keep = I[rank(H_t) < k]     rank 0 the highest entropy; equal entropies ranked by position (row-major)
        tau  = the k-th highest H_t (the top-rho threshold)

    as the authors' code (their verl fork, core_algos.get_global_entropy_top_mask: torch.topk over the valid
    tokens, k = int(rho n + 0.9999)): exactly k tokens, so of entropies tied at tau only the first ones are kept,
    where the paper's indicator would keep them all. H_t is the entropy of the policy being updated (the
    authors' code takes it from the update's forward pass); the mask carries no gradient. Aggregating the
    policy loss over the kept tokens, as that code does, makes its token-mean divide by k (the paper writes the
    sum over all tokens).

    Args:
      entropy: [B, T] float, per-token entropy H_t (not differentiated).
      mask: [B, T] mask of valid tokens; padding is never kept.
      fraction: rho in (0, 1] (static); 1 keeps every valid token.

    Returns:
      (keep [B, T] bool, tau: scalar float32; 0 when the mask is empty, and then nothing is kept).
    """
    _validation.check_bt(entropy=entropy, mask=mask)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    p, q = Fraction(fraction).limit_denominator(_MAX_FRACTION_DENOMINATOR).as_integer_ratio()
    valid = mask.astype(bool)
    n = jnp.sum(valid, dtype=jnp.int32)
    k = jnp.maximum(n // q * p + (n % q * p + q - 1) // q, 1)  # ceil(n p / q)
    scores = jnp.where(valid, jax.lax.stop_gradient(entropy).astype(jnp.float32), -jnp.inf).ravel()
    order = jnp.argsort(-scores, stable=True)  # highest first, ties and padding (last) in position order
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    keep = (rank < k).reshape(valid.shape) & valid
    return keep, jnp.where(n > 0, scores[order[k - 1]], 0.0)
