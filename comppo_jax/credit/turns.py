"""Credit across the environment's spans of a multi-turn response (docs/conventions.md, "Turns").

A conversation's response interleaves the policy's tokens with the environment's replies
(`env_mask`). The environment's tokens are not the policy's actions: they carry no advantage, no
return and no loss. Every estimator runs on the policy's tokens alone, in order (`compact`), so
the last token of a turn (its tool call, t) is followed by the first token of the next turn (t'):

    delta_t = r_t + kappa_t V_{t'} - V_t,        A_t = delta_t + lam kappa_t A_{t'}

The paper is silent on the kappa of that crossing; `crossing_gate` sets it:
- "transition": the span is one transition, gated by the call token's own kappa_t (the policy's
  computation at the call decides how much of what follows the reply flows back);
- "pass": the span passes value through, kappa_t = 1 (the reply is not the policy's computation,
  so no gate of it discounts the crossing; lam still does, as at every token).
GAE (kappa = gamma = 1 in PPO) is the same under both; GRPO broadcasts over the policy's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

CROSSINGS = ("pass", "transition")


def call_tokens(env_mask: Bool[Array, "B T"], mask: Shaped[Array, "B T"]) -> Bool[Array, "B T"]:
    """The policy's tokens that end a turn with a call: followed by an environment token."""
    following = jnp.pad(env_mask[:, 1:], ((0, 0), (0, 1)))
    return mask.astype(bool) & ~env_mask & following


def crossing_gate(
    kappa: Float[Array, "B T"], env_mask: Bool[Array, "B T"], mask: Shaped[Array, "B T"], crossing: str
) -> Float[Array, "B T"]:
    """kappa with the crossings' convention (module doc): 1 at call tokens ("pass"), unchanged ("transition")."""
    if crossing not in CROSSINGS:
        raise ValueError(f"credit.env_crossing must be one of {CROSSINGS}, got {crossing!r}")
    if crossing == "transition":
        return kappa
    return jnp.where(call_tokens(env_mask, mask), 1.0, kappa)


def policy_order(env_mask: Bool[Array, "B T"]) -> Int[Array, "B T"]:
    """[B, T] each row's positions with the policy's tokens first, in order (then the environment's)."""
    return jnp.argsort(env_mask, axis=1, stable=True)


def compact(x: Shaped[Array, "B T"], order: Int[Array, "B T"]) -> Shaped[Array, "B T"]:
    """x with each row's policy tokens moved to the front, in order (`policy_order`)."""
    return jnp.take_along_axis(x, order, axis=1)


def expand(x: Shaped[Array, "B T"], order: Int[Array, "B T"]) -> Shaped[Array, "B T"]:
    """The inverse of `compact`: each compacted column back at its position."""
    return jnp.take_along_axis(x, jnp.argsort(order, axis=1), axis=1)


def on_policy_tokens(
    estimator: Callable[..., tuple[Array, ...]],
    env_mask: Bool[Array, "B T"],
    mask: Shaped[Array, "B T"],
    *per_token: Shaped[Array, "B T"],
    **statistics: Shaped[Array, "B T"],
) -> tuple[Array, ...]:
    """`estimator(*per_token, policy_mask, **statistics)` on the policy's tokens alone (`compact`), each [B, T]
    output expanded back: 0 on the environment's tokens (and wherever the estimator gives padding 0)."""
    order = policy_order(env_mask)
    policy = mask.astype(bool) & ~env_mask
    compacted = [compact(x, order) for x in per_token] + [compact(policy, order)]
    outputs = estimator(*compacted, **{name: compact(x, order) for name, x in statistics.items()})
    return tuple(expand(x, order) for x in outputs)
