"""Which gate, critic and advantage estimator each method and control uses.

One config switch, `method`, picks the algorithm; for CompPO, `gate` and `critic.kind` pick the
cell of the paper's 2x2 factorial and the signal controls (sections 6.2-6.4):

| method | gate (kappa in trace and value mix)    | critic      | advantages                     |
|--------|----------------------------------------|-------------|--------------------------------|
| comppo | attention (kappa_t from the rollout)   | tac         | comp_gae (eq. comp_gae)        |
| comppo | fixed (config.fixed_gate) / shuffle / position | tac | comp_gae with that gate   |
| comppo | attention / fixed / ...                | standard    | comp_gae; linear value head    |
| ppo    | gamma (= 1) everywhere                 | standard    | gae (kappa = gamma)            |
| grpo   | -                                      | none        | group-relative (eq. group_broadcast) |

Beyond the paper, `critic.kind=full` gives PPO (or CompPO) the critic PPO usually trains: a full
copy of the policy with a value head (`comppo_jax.critic.value_model`), for cost comparisons.

Beyond the paper, the policy-loss variants compose with every method where they make sense
(`comppo_jax.train.validation` rejects the others): the surrogate (`train.policy_loss`: ppo, gspo
for GRPO, gspo_token), the loss aggregation, DAPO's decoupled clip, dynamic sampling and overlong
shaping, Dr.GRPO's unnormalized group advantages; and for CompPO the gate statistic and the gate
refresh per epoch (comppo_jax.credit.registry.ActorLoss, `config.gate_statistic`, `config.gate_refresh`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from comppo_jax.credit import (
    FIXED_GATE,
    apply_position_schedule,
    fixed_gate,
    registry,
    shuffle_gate,
)
from comppo_jax.critic import (
    init_standard_value_head,
    init_tac,
    init_value_model,
)
from comppo_jax.rollout import response_positions

METHODS = ("comppo", "grpo", "ppo")
GATES = ("attention", "fixed", "shuffle", "position")
CRITICS = ("tac", "standard", "full", "none")
POLICY_LOSSES = tuple(registry.POLICY_LOSSES)
GATE_REFRESH = ("rollout", "epoch")
KL_AGGREGATIONS = ("token-mean", "policy")
PROXIMAL = ("behaviour", "recompute")  # train.proximal: the policy the PPO ratio is clipped against
# config.credit.estimator: beyond the paper, an estimator in place of the method's own, and the method it fits.
ESTIMATOR_METHODS = {"vapo": "ppo", "ktae": "grpo", "attention_anchor": "grpo"}
ESTIMATORS = ("auto",) + tuple(ESTIMATOR_METHODS)
TOKEN_SELECTIONS = ("all", "entropy_top")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the train loop does for a config: the gate control, the critic, the estimator."""

    gate: str  # one of GATES, or "gamma" for PPO
    critic: str  # one of CRITICS
    estimator: str  # a key of comppo_jax.credit.registry.ESTIMATORS: "comp_gae" | "gae" | "grpo" | ...


def recipe(method: str, gate: str = "attention", critic: str = "tac", estimator: str = "auto") -> Recipe:
    """The recipe of `method`; `gate` and `critic` apply to CompPO (its factorial and controls); PPO's
    critic is the standard head unless `critic` is "full". `estimator` (config.credit.estimator)
    replaces the method's own: a critic's (vapo) for PPO, a group's (ktae, attention_anchor) for GRPO."""
    if method not in METHODS:
        raise ValueError(f"config.method={method!r}; expected one of {METHODS}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"config.credit.estimator={estimator!r}; expected one of {ESTIMATORS}")
    if estimator != "auto" and method != ESTIMATOR_METHODS[estimator]:
        raise ValueError(
            f"config.credit.estimator={estimator!r} needs config.method={ESTIMATOR_METHODS[estimator]!r}, "
            f"not {method!r}"
        )
    own = lambda name: name if estimator == "auto" else estimator
    if method == "grpo":
        return Recipe(gate="none", critic="none", estimator=own("grpo"))
    if method == "ppo":
        return Recipe(gate="gamma", critic="full" if critic == "full" else "standard", estimator=own("gae"))
    if gate not in GATES:
        raise ValueError(f"config.gate={gate!r}; expected one of {GATES}")
    if critic not in ("tac", "standard", "full"):
        raise ValueError(f"config.critic.kind={critic!r}; CompPO takes 'tac', 'standard' or 'full'")
    return Recipe(gate=gate, critic=critic, estimator="comp_gae")


def behaviour_pass(recipe: Recipe, old_log_probs: str) -> bool:
    """Whether the scoring pass runs the behaviour policy's forward: for rescored old log-probs,
    the attention gate, the actor features a critic reads or the attention the attention_anchor
    estimator reads. GRPO, and PPO with the full value model, with the sampler's log-probs read none of them."""
    reads_attention = recipe.gate not in ("none", "gamma") or recipe.estimator == "attention_anchor"
    return old_log_probs == "rescore" or reads_attention or recipe.critic in ("tac", "standard")


def control_gate(recipe: Recipe, kappa, mask, rng, position_schedule=None, fixed_value: float = FIXED_GATE):
    """The kappa [B, T] the estimator and the TAC value mix read, for the recipe's gate
    (`fixed_value`: the fixed control's constant, config.fixed_gate)."""
    if recipe.gate == "attention":
        return kappa
    if recipe.gate == "fixed":
        return fixed_gate(mask, fixed_value)
    if recipe.gate == "shuffle":
        return shuffle_gate(kappa, mask, rng)
    if recipe.gate == "position":
        if position_schedule is None:
            raise ValueError(
                "config.gate='position' needs config.position_schedule (a schedule fitted on an earlier run's gates)"
            )
        return apply_position_schedule(position_schedule, mask)
    if recipe.gate == "gamma":
        return jnp.where(mask, 1.0, 0.0).astype(jnp.float32)
    return jnp.zeros(mask.shape, jnp.float32)


def spread_over_sequence(per_token, prompt_lengths, sequence_length: int):
    """[B, T] per-token values -> [B, L] placed at p_t = P - 1 + t (the critic's coordinates)."""
    batch, length = per_token.shape
    positions = response_positions(prompt_lengths, length)
    inside = positions < sequence_length
    out = jnp.zeros((batch, sequence_length), per_token.dtype)
    return out.at[jnp.arange(batch)[:, None], jnp.where(inside, positions, 0)].add(jnp.where(inside, per_token, 0))


def initial_keys(seed: int):
    """(the policy's init key, the critic's init key, the run's key) of `config.seed`."""
    return jax.random.split(jax.random.PRNGKey(seed), 3)


def init_critic(credit, model_config, rng, policy=None, master_dtype="float32"):
    """Fresh critic params for a comppo_jax.train.specs.CreditSpec's recipe (None without a critic);
    the full value model copies the starting `policy`'s trunk into `master_dtype` and draws its value
    head from `rng`."""
    kind = credit.recipe.critic
    if kind == "tac":
        return init_tac(credit.critic_module, rng, len(credit.hidden_layers), model_config.hidden_size, credit.top_k)
    if kind == "full":
        return init_value_model(policy, master_dtype, rng)
    return init_standard_value_head(model_config.hidden_size) if kind == "standard" else None
