"""Advantage estimators and policy losses by name, as a config names them (tunix registers its
advantage estimators the same way): a recipe's `estimator` and `train.policy_loss` are keys here,
and a new one is one entry.

An estimator takes the batch's rewards and the critic's view of it and returns (advantages,
returns) [B, T]; a policy loss takes the log-probs, the ratio's reference, the advantages and the
clip and returns (loss, stats). Both read their settings from a small frozen spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from comppo_jax.credit.advantages import comp_gae, gae, grpo_advantages, whiten_advantages
from comppo_jax.credit.losses import gspo_loss, ppo_clip_loss


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """What an estimator reads besides the batch: its name (a key of ESTIMATORS), lambda, the group
    size and whether GRPO divides by the group's reward std."""

    name: str = "comp_gae"
    lam: float = 0.95
    group: int = 4
    normalize_std: bool = True


def comp_gae_credit(
    spec: EstimatorSpec, rewards: ArrayLike, reward_tokens: ArrayLike, values: Array, kappa: Array, mask: Array
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Comp-GAE, paper eq. (comp_gae), with the controlled gate `kappa`; advantages whitened."""
    advantages, returns = comp_gae(jnp.asarray(reward_tokens), values, kappa, mask, spec.lam)
    return whiten_advantages(advantages, mask), returns


def gae_credit(
    spec: EstimatorSpec, rewards: ArrayLike, reward_tokens: ArrayLike, values: Array, kappa: Array, mask: Array
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """GAE, paper eq. (stdgae) with gamma = 1 (PPO); advantages whitened."""
    advantages, returns = gae(jnp.asarray(reward_tokens), values, mask, gamma=1.0, lam=spec.lam)
    return whiten_advantages(advantages, mask), returns


def grpo_credit(
    spec: EstimatorSpec, rewards: ArrayLike, reward_tokens: ArrayLike, values: Array, kappa: Array, mask: Array
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """GRPO's group-relative advantage broadcast over each response, paper eq. (group_broadcast)
    (Dr.GRPO without the std: normalize_std=False); no returns (no critic)."""
    advantages = grpo_advantages(jnp.asarray(rewards), spec.group, mask, normalize_std=spec.normalize_std)
    return advantages, jnp.zeros(mask.shape)


ESTIMATORS: dict[str, Callable] = {"comp_gae": comp_gae_credit, "gae": gae_credit, "grpo": grpo_credit}


def estimate(
    spec: EstimatorSpec, rewards: ArrayLike, reward_tokens: ArrayLike, values: Array, kappa: Array, mask: Array
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """(advantages, returns) [B, T] of the estimator `spec.name` (ESTIMATORS)."""
    return ESTIMATORS[spec.name](spec, rewards, reward_tokens, values, kappa, mask)


@dataclasses.dataclass(frozen=True)
class ActorLoss:
    """The actor's loss as a config fixes it (static under jit): `policy_loss` (a key of
    POLICY_LOSSES), the resolved loss aggregation, the decoupled upper clip's scale, the token-sum
    normalizer (max_new_tokens), GSPO's sequence clip, whether the reference KL term is in the loss
    at all and how it is aggregated, and the sampling temperature its log-probs are taken at."""

    policy_loss: str = "ppo"
    aggregation: str = "token-mean"
    clip_high_scale: float = 1.0
    norm_length: int | None = None
    sequence_clip: tuple[float, float] = (3e-4, 4e-4)  # GSPO's (low, high) clip of the sequence ratio
    kl_term: bool = True
    kl_aggregation: str = "token-mean"
    temperature: float = 1.0


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
