"""Advantage estimators and policy losses by name, as a config names them (tunix registers its
advantage estimators the same way): a recipe's `estimator` and `train.policy_loss` are keys here,
and a new one is one entry.

An estimator takes the batch's rewards, its response tokens and the critic's view of it and returns
(advantages, returns) [B, T]; a policy loss takes the log-probs, the ratio's reference, the advantages and the
clip and returns (loss, stats). Both read their settings from a small frozen spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from comppo_jax.credit import turns
from comppo_jax.credit.advantages import comp_gae, gae, grpo_advantages, vapo_lambda, whiten_advantages
from comppo_jax.credit.attention_credit import attention_anchor_advantages
from comppo_jax.credit.key_tokens import ktae_advantages
from comppo_jax.credit.losses import gspo_loss, ppo_clip_loss


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """What an estimator reads besides the batch: its name (a key of ESTIMATORS), lambda, the group
    size, whether GRPO divides by the group's reward std, and the settings of the estimators beyond the
    paper (config.credit)."""

    name: str = "comp_gae"
    lam: float = 0.95
    group: int = 4
    normalize_std: bool = True
    vapo_alpha: float = 0.05
    vapo_critic_lam: float = 1.0
    # attention_anchor: TopQ's fraction q, gamma_amp, and the FAI horizon (H_lo, H_hi) the scoring pass reads
    anchor_fraction: float = 0.4
    anchor_amplification: float = 1.5
    anchor_horizon: tuple[int, int] = (10, 100)
    # ktae: the strength's weights h1 (Fisher), h2 (information gain), the direction's h3 (BM25 ratio), the
    # values' range (-scale, scale), and the end-of-sequence ids (model.arch.eos_token_ids), which get none
    ktae_fisher_weight: float = 1.0
    ktae_ig_weight: float = 1.0
    ktae_tf_weight: float = 1.0
    ktae_scale: float = 1.0
    ktae_end_tokens: tuple[int, ...] = ()
    # multi-turn responses: the gate's crossing of an environment span (comppo_jax.credit.turns.CROSSINGS)
    env_crossing: str = "transition"


def comp_gae_credit(
    spec: EstimatorSpec,
    rewards: ArrayLike,
    reward_tokens: ArrayLike,
    response_tokens: Array,
    values: Array,
    kappa: Array,
    mask: Array,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Comp-GAE, paper eq. (comp_gae), with the controlled gate `kappa`; advantages whitened."""
    advantages, returns = comp_gae(jnp.asarray(reward_tokens), values, kappa, mask, spec.lam)
    return whiten_advantages(advantages, mask), returns


def gae_credit(
    spec: EstimatorSpec,
    rewards: ArrayLike,
    reward_tokens: ArrayLike,
    response_tokens: Array,
    values: Array,
    kappa: Array,
    mask: Array,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """GAE, paper eq. (stdgae) with gamma = 1 (PPO); advantages whitened."""
    advantages, returns = gae(jnp.asarray(reward_tokens), values, mask, gamma=1.0, lam=spec.lam)
    return whiten_advantages(advantages, mask), returns


def grpo_credit(
    spec: EstimatorSpec,
    rewards: ArrayLike,
    reward_tokens: ArrayLike,
    response_tokens: Array,
    values: Array,
    kappa: Array,
    mask: Array,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """GRPO's group-relative advantage broadcast over each response, paper eq. (group_broadcast)
    (Dr.GRPO without the std: normalize_std=False); no returns (no critic)."""
    advantages = grpo_advantages(jnp.asarray(rewards), spec.group, mask, normalize_std=spec.normalize_std)
    return advantages, jnp.zeros(mask.shape)


def vapo_credit(
    spec: EstimatorSpec,
    rewards: ArrayLike,
    reward_tokens: ArrayLike,
    response_tokens: Array,
    values: Array,
    kappa: Array,
    mask: Array,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """VAPO's decoupled, length-adaptive GAE (Yue et al. 2025, arXiv 2504.05118), gamma = 1 as PPO: the
    advantages from GAE with each response's own lambda_policy = 1 - 1 / (alpha l) (`vapo_lambda`), whitened;
    the critic's targets from GAE with lambda_critic (1: the Monte-Carlo return). train.lam is not read."""
    reward_tokens = jnp.asarray(reward_tokens)
    policy_lam = vapo_lambda(mask.astype(bool).sum(axis=1), spec.vapo_alpha)
    advantages, _ = gae(reward_tokens, values, mask, gamma=1.0, lam=policy_lam)
    _, returns = gae(reward_tokens, values, mask, gamma=1.0, lam=spec.vapo_critic_lam)
    return whiten_advantages(advantages, mask), returns


def attention_anchor_credit(
    spec: EstimatorSpec,
    rewards: ArrayLike,
    reward_tokens: ArrayLike,
    response_tokens: Array,
    values: Array,
    kappa: Array,
    mask: Array,
    influence: Array | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Global-anchor credit (Li et al. 2025, section 5.2 (2)): `attention_anchor_advantages` on the scoring
    pass's future attention influence (`influence` [B, T], Rollout.influence), not whitened, as GRPO's; no
    returns (no critic)."""
    if influence is None:
        raise ValueError(
            "credit.estimator=attention_anchor reads the scoring pass's future attention influence "
            "(Rollout.influence): score with influence_horizon"
        )
    advantages = attention_anchor_advantages(
        rewards,
        mask,
        influence,
        spec.group,
        normalize_std=spec.normalize_std,
        fraction=spec.anchor_fraction,
        horizon_lo=spec.anchor_horizon[0],
        amplification=spec.anchor_amplification,
    )
    return advantages, jnp.zeros(mask.shape)


def ktae_credit(
    spec: EstimatorSpec,
    rewards: ArrayLike,
    reward_tokens: ArrayLike,
    response_tokens: Array,
    values: Array,
    kappa: Array,
    mask: Array,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """KTAE (Sun et al. 2025, arXiv 2505.16826, method section): GRPO's group-relative advantage (the std as
    train.group_std_normalization says) plus each token's key-token value from its group's rollouts
    (`ktae_advantages`), not whitened, as GRPO's; no returns (no critic)."""
    advantages = ktae_advantages(
        jnp.asarray(rewards),
        response_tokens,
        mask,
        spec.group,
        normalize_std=spec.normalize_std,
        fisher_weight=spec.ktae_fisher_weight,
        ig_weight=spec.ktae_ig_weight,
        tf_weight=spec.ktae_tf_weight,
        scale=spec.ktae_scale,
        end_tokens=spec.ktae_end_tokens,
    )
    return advantages, jnp.zeros(mask.shape)


ESTIMATORS: dict[str, Callable] = {
    "comp_gae": comp_gae_credit,
    "gae": gae_credit,
    "grpo": grpo_credit,
    "vapo": vapo_credit,
    "attention_anchor": attention_anchor_credit,
    "ktae": ktae_credit,
}


class Statistics(NamedTuple):
    """What some estimators read besides the batch: the scoring pass's future attention influence [B, T]
    (Rollout.influence: attention_anchor's), and a conversation's environment tokens [B, T]."""

    influence: Array | None = None
    env_mask: Array | None = None


NO_STATISTICS = Statistics()


def estimate(
    spec: EstimatorSpec,
    rewards: ArrayLike,
    reward_tokens: ArrayLike,
    response_tokens: Array,
    values: Array,
    kappa: Array,
    mask: Array,
    statistics: Statistics = NO_STATISTICS,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """(advantages, returns) [B, T] of the estimator `spec.name` (ESTIMATORS): from the terminal rewards [B],
    the reward at each row's last token [B, T], the response token ids [B, T], the critic's values [B, T], the
    (controlled) gate [B, T] and the mask of the policy's response tokens [B, T]. `statistics.influence` goes to
    the estimator that reads it (attention_anchor); with `statistics.env_mask` [B, T], a multi-turn response's
    environment tokens, the estimator runs on the policy's tokens alone, the crossings gated as
    `spec.env_crossing` says (comppo_jax.credit.turns), and the environment's tokens get 0."""
    influence, env_mask = statistics
    named = {} if influence is None else {"influence": influence}
    estimator = ESTIMATORS[spec.name]
    if env_mask is None:
        return estimator(spec, rewards, reward_tokens, response_tokens, values, kappa, mask, **named)
    kappa = turns.crossing_gate(kappa, env_mask, mask, spec.env_crossing)
    on_turns = lambda *per_token, **compacted: estimator(spec, rewards, *per_token, **compacted)
    advantages, returns = turns.on_policy_tokens(
        on_turns, env_mask, mask, jnp.asarray(reward_tokens), response_tokens, values, kappa, **named
    )
    return advantages, returns


def realized_transport(spec: EstimatorSpec, kappa: ArrayLike, mask: ArrayLike) -> np.ndarray:
    """c_t of A_t = delta_t + c_t A_{t+1} as the estimator `spec.name` applies it, [B, T] on the host (what a
    trace keeps of the next token's advantage): lam kappa_t for Comp-GAE (kappa the controlled gate), lam for GAE
    and each response's own lambda for VAPO (gamma 1), and 1 for the estimators that give every token of a
    response its outcome (GRPO, KTAE, attention anchors)."""
    mask = np.asarray(mask, bool)
    if spec.name == "comp_gae":
        return spec.lam * np.asarray(kappa, np.float64)
    if spec.name == "gae":
        return np.full(mask.shape, spec.lam)
    if spec.name == "vapo":
        return np.broadcast_to(
            np.asarray(vapo_lambda(mask.sum(axis=1), spec.vapo_alpha), np.float64)[:, None], mask.shape
        )
    return np.ones(mask.shape)


@dataclasses.dataclass(frozen=True)
class ActorLoss:
    """The actor's loss as a config fixes it (static under jit): `policy_loss` (a key of
    POLICY_LOSSES), the resolved loss aggregation, the decoupled upper clip's scale, the token-sum
    normalizer (max_new_tokens), GSPO's sequence clip, whether the reference KL term is in the loss
    at all and how it is aggregated, the sampling temperature its log-probs are taken at, and which
    tokens the surrogate counts: all, or the `token_selection_fraction` of highest entropy
    ("entropy_top", `losses.entropy_top_mask`)."""

    policy_loss: str = "ppo"
    aggregation: str = "token-mean"
    clip_high_scale: float = 1.0
    norm_length: int | None = None
    sequence_clip: tuple[float, float] = (3e-4, 4e-4)  # GSPO's (low, high) clip of the sequence ratio
    kl_term: bool = True
    kl_aggregation: str = "token-mean"
    temperature: float = 1.0
    token_selection: str = "all"
    token_selection_fraction: float = 0.2


def ppo_surrogate(
    loss: ActorLoss, log_probs: Array, old_log_probs: Array, advantages: Array, mask: Array, clip: Any
) -> tuple[Array, dict]:
    """PPO's per-token ratio, paper eq. (ppo_outer), clipped to [1 - clip, 1 + clip * clip_high_scale]."""
    return ppo_clip_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        clip,
        clip * loss.clip_high_scale,
        aggregation=loss.aggregation,
        norm_length=loss.norm_length,
    )


def gspo_surrogate(
    loss: ActorLoss,
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    mask: Array,
    clip: Any,
    token_level: bool = False,
) -> tuple[Array, dict]:
    """GSPO's length-normalized sequence ratio at its own clip range (`clip` does not apply)."""
    low, high = loss.sequence_clip
    return gspo_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        low,
        high,
        token_level=token_level,
        aggregation=loss.aggregation,
        norm_length=loss.norm_length,
    )


def gspo_token_surrogate(
    loss: ActorLoss, log_probs: Array, old_log_probs: Array, advantages: Array, mask: Array, clip: Any
) -> tuple[Array, dict]:
    """GSPO's sequence ratio carrying per-token advantages (GSPO-token)."""
    return gspo_surrogate(loss, log_probs, old_log_probs, advantages, mask, clip, token_level=True)


POLICY_LOSSES: dict[str, Callable] = {"ppo": ppo_surrogate, "gspo": gspo_surrogate, "gspo_token": gspo_token_surrogate}


def surrogate(
    loss: ActorLoss, log_probs: Array, old_log_probs: Array, advantages: Array, mask: Array, clip: Any
) -> tuple[Array, dict]:
    """(loss, stats) of the clipped surrogate `loss.policy_loss` (POLICY_LOSSES)."""
    return POLICY_LOSSES[loss.policy_loss](loss, log_probs, old_log_probs, advantages, mask, clip)
