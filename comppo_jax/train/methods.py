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
refresh per epoch (`ActorLoss`, `config.gate_statistic`, `config.gate_refresh`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from comppo_jax.credit import FIXED_GATE, apply_position_schedule, fixed_gate, load_position_schedule, shuffle_gate
from comppo_jax.critic import (
    critic_from_config,
    fused_hidden_layers,
    init_standard_value_head,
    init_tac,
    init_value_model,
)
from comppo_jax.rollout import response_positions

METHODS = ("comppo", "grpo", "ppo")
GATES = ("attention", "fixed", "shuffle", "position")
CRITICS = ("tac", "standard", "full", "none")
POLICY_LOSSES = ("ppo", "gspo", "gspo_token")
GATE_REFRESH = ("rollout", "epoch")
KL_AGGREGATIONS = ("token-mean", "policy")
PROXIMAL = ("behaviour", "recompute")  # train.proximal: the policy the PPO ratio is clipped against


@dataclasses.dataclass(frozen=True)
class ActorLoss:
    """The actor's loss as a config fixes it (static under jit): `train.policy_loss`, the resolved
    `train.loss_aggregation`, `train.clip_high_scale`, the token-sum normalizer (max_new_tokens),
    whether the reference KL term is in the loss at all and how it is aggregated."""

    policy_loss: str = "ppo"
    aggregation: str = "token-mean"
    clip_high_scale: float = 1.0
    norm_length: int | None = None
    sequence_clip: tuple[float, float] = (3e-4, 4e-4)  # GSPO's (low, high) clip of the sequence ratio
    kl_term: bool = True
    kl_aggregation: str = "token-mean"


def loss_aggregation(train) -> str:
    """`train.loss_aggregation`, with "auto" resolved to the objective of the variant's own paper:
    GSPO's sequence mean for gspo / gspo_token, Dr.GRPO's constant normalizer (mean over responses
    of token sums / max_new_tokens) without the group std, token-mean (the paper's, DAPO's) otherwise."""
    if train.loss_aggregation != "auto":
        return train.loss_aggregation
    if train.policy_loss in ("gspo", "gspo_token"):
        return "seq-mean-token-mean"
    if not train.group_std_normalization:
        return "seq-mean-token-scale"
    return "token-mean"


# Fields whose value "auto" stands for another, as a training config resolves it (--help shows it).
RESOLVED_FIELDS = {"train.loss_aggregation": lambda cfg: loss_aggregation(cfg.train)}


def kl_coefficient(cfg) -> float:
    """The reference-KL coefficient of the config's method (GRPO has its own, tuned separately)."""
    return cfg.train.kl_coef_grpo if cfg.method == "grpo" else cfg.train.kl_coef


def kl_term(cfg) -> bool:
    """Whether the actor's loss has the reference-KL term (and the scoring pass the reference forward)."""
    return kl_coefficient(cfg) > 0


def actor_loss_of(cfg) -> ActorLoss:
    """The `ActorLoss` of a training config: a zero KL coefficient drops the KL term (and, in the
    loop, the reference forward pass); train.kl_aggregation=policy aggregates it as the policy loss."""
    train = cfg.train
    aggregation = loss_aggregation(train)
    return ActorLoss(
        train.policy_loss,
        aggregation,
        float(train.clip_high_scale),
        cfg.rollout.max_new_tokens,
        (float(train.gspo_clip_low), float(train.gspo_clip_high)),
        kl_term=kl_term(cfg),
        kl_aggregation=aggregation if train.kl_aggregation == "policy" else "token-mean",
    )


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the train loop does for a config: the gate control, the critic, the estimator."""

    gate: str  # one of GATES, or "gamma" for PPO
    critic: str  # one of CRITICS
    estimator: str  # "comp_gae" | "gae" | "grpo"


def recipe(method: str, gate: str = "attention", critic: str = "tac") -> Recipe:
    """The recipe of `method`; `gate` and `critic` apply to CompPO (its factorial and controls); PPO's
    critic is the standard head unless `critic` is "full"."""
    if method not in METHODS:
        raise ValueError(f"config.method={method!r}; expected one of {METHODS}")
    if method == "grpo":
        return Recipe(gate="none", critic="none", estimator="grpo")
    if method == "ppo":
        return Recipe(gate="gamma", critic="full" if critic == "full" else "standard", estimator="gae")
    if gate not in GATES:
        raise ValueError(f"config.gate={gate!r}; expected one of {GATES}")
    if critic not in ("tac", "standard", "full"):
        raise ValueError(f"config.critic.kind={critic!r}; CompPO takes 'tac', 'standard' or 'full'")
    return Recipe(gate=gate, critic=critic, estimator="comp_gae")


def behaviour_pass(recipe: Recipe, old_log_probs: str) -> bool:
    """Whether the scoring pass runs the behaviour policy's forward: for rescored old log-probs,
    the attention gate or the actor features a critic reads. GRPO, and PPO with the full value
    model, with the sampler's log-probs read none of them."""
    return old_log_probs == "rescore" or recipe.gate not in ("none", "gamma") or recipe.critic in ("tac", "standard")


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


# --- What a run config fixes about its start, scoring, credit and the step count --------------------


def initial_keys(seed: int):
    """(the policy's init key, the critic's init key, the run's key) of `config.seed`."""
    return jax.random.split(jax.random.PRNGKey(seed), 3)


def base_source(cfg) -> str:
    """Where a run's starting policy (a LoRA run's frozen base) comes from, in words."""
    loaded = cfg.model.path or f"model.arch at random (seed {cfg.seed})"
    return loaded + (f", warm-started {cfg.warm_start.steps} steps" if cfg.warm_start.steps else "")


class RunParts(NamedTuple):
    """What a config fixes about scoring and credit: the recipe, the critic's features and module."""

    recipe: Recipe
    hidden_layers: tuple[int, ...]  # HF hidden states the critic reads
    top_k: int | None  # TAC routing width (None: no routing)
    critic_module: Any  # the TAC module, or None
    position_schedule: Any  # the position-only control's schedule, or None


def run_parts(cfg, model_config) -> RunParts:
    made = recipe(cfg.method, cfg.gate, cfg.critic.kind)
    n = model_config.num_layers
    # Only TAC's fused layers are checked against the model: no other critic reads them.
    hidden_layers = (
        fused_hidden_layers(n, cfg.critic.fused_layers)
        if made.critic == "tac"
        else {"standard": (n,)}.get(made.critic, ())
    )
    position_schedule = load_position_schedule(cfg.position_schedule) if made.gate == "position" else None
    return RunParts(
        made,
        hidden_layers,
        cfg.critic.top_k if made.critic == "tac" else None,
        critic_from_config(cfg.critic) if made.critic == "tac" else None,
        position_schedule,
    )


def init_critic(parts: RunParts, model_config, rng, policy=None, master_dtype="float32"):
    """Fresh critic params for the recipe (None without a critic); the full value model copies the
    starting `policy`'s trunk into `master_dtype` and draws its value head from `rng`."""
    if parts.recipe.critic == "tac":
        return init_tac(parts.critic_module, rng, len(parts.hidden_layers), model_config.hidden_size, parts.top_k)
    if parts.recipe.critic == "full":
        return init_value_model(policy, master_dtype, rng)
    return init_standard_value_head(model_config.hidden_size) if parts.recipe.critic == "standard" else None


def gate_options(cfg) -> dict:
    """The gate's keywords for a config (`policy_gate`'s, and part of `score_rollout`'s)."""
    return dict(
        window=cfg.rollout.window,
        gate_statistic=cfg.gate_statistic,
        sink_tokens=cfg.sink_tokens,
        **cfg.gate_envelope.to_dict(),
    )


def scoring_options(cfg, parts: RunParts) -> dict:
    """`score_rollout`'s keywords for a config (all but the kernel backend)."""
    return dict(
        temperature=cfg.rollout.temperature,
        hidden_layers=parts.hidden_layers,
        top_k=parts.top_k,
        old_log_probs=cfg.rollout.old_log_probs,
        behaviour_pass=behaviour_pass(parts.recipe, cfg.rollout.old_log_probs),
        **gate_options(cfg),
    )


def critic_epochs_first(cfg, made: Recipe) -> bool:
    """Whether a step runs all of the critic's epochs before the actor's. Within a step the two
    are independent (the critic's targets and the values are fixed at the credit), so the order
    changes nothing, unless gate_refresh=epoch recomputes the returns and the gate from each
    epoch's actor. First, the critic's features can be freed before the actor's epochs."""
    return made.critic != "none" and cfg.gate_refresh != "epoch"


def critic_warmup(cfg, made: Recipe) -> int:
    """Critic-only steps at the start of the run (none without a critic)."""
    return cfg.train.critic_warmup_steps if made.critic != "none" else 0


def total_steps(cfg, made: Recipe) -> int:
    """The run's loop steps: `steps` actor updates after the critic warm-up, or, with
    train.critic_warmup_counts_toward_steps (the paper's literal reading), `steps` in all."""
    return cfg.steps if cfg.train.critic_warmup_counts_toward_steps else cfg.steps + critic_warmup(cfg, made)


def prepended_warmup(cfg, made: Recipe) -> int:
    """Warm-up steps added on top of `steps`: the reward schedule, the knobs' drift and the dev
    evaluations count from the first actor update after them, as in a run without a critic."""
    return total_steps(cfg, made) - cfg.steps


def schedule_step(cfg, made: Recipe, step: int) -> int:
    """What the reward schedule and the knobs' drift read at step `step` (1-based): the steps
    after the prepended critic warm-up that came before it."""
    return max(step - 1 - prepended_warmup(cfg, made), 0)
