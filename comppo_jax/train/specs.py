"""A training config resolved once into the small frozen specs its stages read.

PureJaxRL reads its config once in `make_train`; `resolve(cfg, model_config)` is that one read for
what a run computes. Below it every stage and every function on the data path takes the spec it
needs, never the config. The whole config is otherwise read only where it is validated
(comppo_jax.train.validation), recorded (config.json: comppo_jax.train.schema), compared on resume
(comppo_jax.runs.run_dir) and by the launchers' entry points.

    RunSpec
      rollout:  RolloutStageSpec  the prompt stream, the experience (sampling, dynamic sampling,
                                  scoring: comppo_jax.rollout.experience) and the reward schedule
      learner:  LearnerSpec       credit (the gate control and the estimator, by name:
                                  comppo_jax.credit.registry), the update epochs, the controller
      recorder: RecorderSpec      metrics, kept responses, checkpoints, the summary
      steps:    Steps             the loop's steps and the critic warm-up
"""

from __future__ import annotations

import dataclasses
from typing import Any

from comppo_jax.credit import load_position_schedule
from comppo_jax.credit.registry import ActorLoss, EstimatorSpec
from comppo_jax.critic import critic_from_config, fused_hidden_layers
from comppo_jax.rollout import engine_options
from comppo_jax.rollout.experience import ExperienceSpec, GateSpec, RolloutSpec, ScoringSpec
from comppo_jax.runs.outputs import parse_loggers
from comppo_jax.train import controller
from comppo_jax.train.controller import ControllerConfig, RewardSchedule
from comppo_jax.train.methods import Recipe, behaviour_pass, recipe


@dataclasses.dataclass(frozen=True)
class Steps:
    """The run's loop steps: `steps` actor updates after the critic warm-up of `warmup` critic-only
    steps, which come on top unless train.critic_warmup_counts_toward_steps (the paper's literal
    reading: `steps` in all)."""

    steps: int
    warmup: int
    total: int

    @property
    def prepended(self) -> int:
        """Warm-up steps added on top of `steps`: the reward schedule, the knobs' drift and the dev
        evaluations count from the first actor update after them, as in a run without a critic."""
        return self.total - self.steps

    def schedule_step(self, step: int) -> int:
        """What the reward schedule and the knobs' drift read at step `step` (1-based): the steps
        after the prepended critic warm-up that came before it."""
        return max(step - 1 - self.prepended, 0)

    def actor_updates(self, step: int) -> int:
        return max(0, step - self.warmup)


@dataclasses.dataclass(frozen=True)
class CreditSpec:
    """How a scored batch gets its credit: the recipe (gate control, critic, estimator), the
    estimator's settings, the fixed control's constant, the position-only control's schedule, the
    gate a refresh recomputes, and the critic's module and features."""

    recipe: Recipe
    estimator: EstimatorSpec
    fixed_gate: float
    gate: GateSpec
    position_schedule: Any = None  # comppo_jax.credit.PositionSchedule (gate=position)
    critic_module: Any = None  # the TAC module, or None
    hidden_layers: tuple[int, ...] = ()  # HF hidden states the critic reads
    top_k: int | None = None  # TAC routing width (None: no routing)


@dataclasses.dataclass(frozen=True)
class LearnerSpec:
    """The learner's settings: credit, the actor's loss, learning rates and the reference KL
    coefficient (the controller's knobs multiply them), minibatches, the gate refresh, the proximal
    policy of AReaL's decoupled objective, the sampler -> scorer mismatch and its rollout correction,
    the skipped-update guard and the controller."""

    credit: CreditSpec
    actor_loss: ActorLoss
    steps: Steps
    controller: ControllerConfig
    actor_lr: float
    critic_lr: float
    kl_coef: float
    minibatch_size: int
    seed: int  # the minibatch shuffles
    gate_refresh: str
    critic_first: bool  # every critic epoch before the actor's (`critic_epochs_first`)
    proximal: str
    importance_weight_cap: float
    importance_weight_rule: str
    max_skipped_updates: int
    packing: bool = False  # minibatches on packed rows (comppo_jax.models.packing)
    packing_min_saving: float = 0.0  # ... when that saves at least this fraction of a minibatch's rows
    rescored: bool = False  # rollout.old_log_probs=rescore: the old log-probs are the scorer's, not the sampler's
    rollout_correction: str = "none"  # none | tis | mis
    rollout_correction_cap: float = 2.0
    rollout_correction_level: str = "token"  # token | sequence | geometric
    rollout_correction_lower_cap: float = 0.0  # mis: rho under it leaves the loss too (0: 1 / cap)


@dataclasses.dataclass(frozen=True)
class RolloutStageSpec:
    """The rollout stage's settings: the prompt stream (prompts per step, its seed), how far ahead it
    runs, the experience, the reward schedule and the decode layout's choice (rollout.mesh.tensor)."""

    experience: ExperienceSpec
    prompts_per_step: int
    seed: int
    staleness: int
    reward_schedule: RewardSchedule
    steps: Steps
    decode_tensor: str | int = "auto"


@dataclasses.dataclass(frozen=True)
class KeptSpec:
    """Which steps keep sampled responses and how much of each (config section `outputs`)."""

    sample_every: int
    samples_per_step: int
    sample_tokens: int


@dataclasses.dataclass(frozen=True)
class RecorderSpec:
    """The recorder's settings: where the run writes, what it logs and keeps, when it checkpoints
    and evaluates, and what the summary and kept responses name."""

    output_dir: str
    method: str
    seed: int
    steps: Steps
    credit: CreditSpec
    loggers: tuple[str, ...]
    eval_every: int
    checkpoint_every: int
    plot: bool
    max_new_tokens: int
    staleness: int
    group: int
    kept: KeptSpec
    # The whole config as a W&B run records it (launch options aside, as config.json has them).
    record: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def evaluates(self, step: int) -> bool:
        """Whether step `step` ends with a dev evaluation (every train.eval_every actor-update steps)."""
        every, prepended = self.eval_every, self.steps.prepended
        return bool(every) and step > prepended and (step - prepended) % every == 0


@dataclasses.dataclass(frozen=True)
class RunSpec:
    rollout: RolloutStageSpec
    learner: LearnerSpec
    recorder: RecorderSpec
    steps: Steps


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
        kl_term=kl_coefficient(cfg) > 0,
        kl_aggregation=aggregation if train.kl_aggregation == "policy" else "token-mean",
        temperature=cfg.rollout.temperature,
        token_selection=train.token_selection,
        token_selection_fraction=float(train.token_selection_fraction),
    )


def base_source(cfg) -> str:
    """Where a run's starting policy (a LoRA run's frozen base) comes from, in words."""
    loaded = cfg.model.path or f"model.arch at random (seed {cfg.seed})"
    return loaded + (f", warm-started {cfg.warm_start.steps} steps" if cfg.warm_start.steps else "")


def critic_epochs_first(cfg, made: Recipe) -> bool:
    """Whether a step runs all of the critic's epochs before the actor's. Within a step the two
    are independent (the critic's targets and the values are fixed at the credit), so the order
    changes nothing, unless gate_refresh=epoch recomputes the returns and the gate from each
    epoch's actor. First, the critic's features can be freed before the actor's epochs."""
    return made.critic != "none" and cfg.gate_refresh != "epoch"


def run_recipe(cfg) -> Recipe:
    """The config's recipe: its method, and for CompPO its gate control and critic."""
    return recipe(cfg.method, cfg.gate, cfg.critic.kind, cfg.credit.estimator)


def steps_of(cfg, made: Recipe) -> Steps:
    warmup = cfg.train.critic_warmup_steps if made.critic != "none" else 0
    total = cfg.steps if cfg.train.critic_warmup_counts_toward_steps else cfg.steps + warmup
    return Steps(cfg.steps, warmup, total)


def gate_spec(cfg) -> GateSpec:
    envelope = cfg.gate_envelope
    return GateSpec(
        cfg.rollout.window, cfg.gate_statistic, cfg.sink_tokens, envelope.kappa_lo, envelope.kappa_hi, envelope.tau
    )


def estimator_spec(cfg, made: Recipe) -> EstimatorSpec:
    """The estimator's settings: lambda, the group, GRPO's std and config.credit's."""
    credit = cfg.credit
    return EstimatorSpec(
        made.estimator,
        cfg.train.lam,
        cfg.rollout.samples_per_prompt,
        cfg.train.group_std_normalization,
        vapo_alpha=credit.vapo_alpha,
        vapo_critic_lam=credit.vapo_critic_lam,
        anchor_fraction=credit.attention_anchor_fraction,
        anchor_amplification=credit.attention_anchor_amplification,
        anchor_horizon=(credit.attention_anchor_horizon_lo, credit.attention_anchor_horizon_hi),
        ktae_fisher_weight=credit.ktae_fisher_weight,
        ktae_ig_weight=credit.ktae_ig_weight,
        ktae_tf_weight=credit.ktae_tf_weight,
        ktae_scale=credit.ktae_scale,
        ktae_end_tokens=tuple(cfg.model.arch.get("eos_token_ids", ())),
        env_crossing=credit.get("env_crossing", "transition"),
    )


def credit_spec(cfg, model_config) -> CreditSpec:
    """The config's credit: its recipe, the critic's features (only TAC's fused layers are checked
    against the model: no other critic reads them) and module, the estimator's settings."""
    made = run_recipe(cfg)
    n = model_config.num_layers
    tac = made.critic == "tac"
    hidden_layers = fused_hidden_layers(n, cfg.critic.fused_layers) if tac else {"standard": (n,)}.get(made.critic, ())
    return CreditSpec(
        made,
        estimator_spec(cfg, made),
        cfg.fixed_gate,
        gate_spec(cfg),
        position_schedule=load_position_schedule(cfg.position_schedule) if made.gate == "position" else None,
        critic_module=critic_from_config(cfg.critic) if tac else None,
        hidden_layers=tuple(hidden_layers),
        top_k=cfg.critic.top_k if tac else None,
    )


def experience_spec(cfg, credit: CreditSpec) -> ExperienceSpec:
    rollout = cfg.rollout
    return ExperienceSpec(
        RolloutSpec(
            rollout.samples_per_prompt,
            rollout.max_new_tokens,
            rollout.temperature,
            rollout.top_p,
            **engine_options(rollout),
            weight_dtype=rollout.get("weight_dtype", "auto"),
            dynamic_sampling=rollout.dynamic_sampling,
            dynamic_sampling_filter=rollout.dynamic_sampling_filter,
            max_refills=rollout.max_refills,
            environment=rollout.get("environment", ""),
            max_turns=rollout.get("max_turns", 4),
            max_reply_tokens=rollout.get("max_reply_tokens", 32),
        ),
        ScoringSpec(
            rollout.temperature,
            rollout.old_log_probs,
            behaviour_pass(credit.recipe, rollout.old_log_probs),
            credit.hidden_layers,
            credit.top_k,
            credit.gate,
            cfg.train.packing,
            cfg.train.packing_min_saving,
            credit.estimator.anchor_horizon if credit.recipe.estimator == "attention_anchor" else None,
        ),
    )


def learner_spec(cfg, credit: CreditSpec, steps: Steps) -> LearnerSpec:
    train = cfg.train
    return LearnerSpec(
        credit,
        actor_loss_of(cfg),
        steps,
        controller.controller_config(cfg.controller),
        train.actor_lr,
        train.critic_lr,
        kl_coefficient(cfg),
        train.minibatch_size,
        cfg.seed,
        cfg.gate_refresh,
        critic_first=critic_epochs_first(cfg, credit.recipe),
        proximal=train.proximal,
        importance_weight_cap=train.importance_weight_cap,
        importance_weight_rule=train.importance_weight_rule,
        max_skipped_updates=train.max_skipped_updates,
        packing=train.packing,
        packing_min_saving=train.packing_min_saving,
        rescored=cfg.rollout.old_log_probs == "rescore",
        rollout_correction=train.rollout_correction,
        rollout_correction_cap=float(train.rollout_correction_cap),
        rollout_correction_level=train.rollout_correction_level,
        rollout_correction_lower_cap=float(train.rollout_correction_lower_cap),
    )


def recorder_spec(cfg, credit: CreditSpec, steps: Steps) -> RecorderSpec:
    outputs = cfg.outputs
    return RecorderSpec(
        cfg.output_dir,
        cfg.method,
        cfg.seed,
        steps,
        credit,
        parse_loggers(cfg.loggers),
        cfg.train.eval_every,
        cfg.checkpoint.every,
        cfg.plot,
        cfg.rollout.max_new_tokens,
        cfg.rollout.staleness,
        cfg.rollout.samples_per_prompt,
        KeptSpec(outputs.sample_every, outputs.samples_per_step, outputs.sample_tokens),
        record=cfg.to_dict(),
    )


def resolve(cfg, model_config) -> RunSpec:
    """The run's specs (module docstring) for a validated config and its model."""
    credit = credit_spec(cfg, model_config)
    steps = steps_of(cfg, credit.recipe)
    rollout = RolloutStageSpec(
        experience_spec(cfg, credit),
        cfg.rollout.prompts_per_step,
        cfg.seed,
        cfg.rollout.staleness,
        controller.reward_schedule(cfg.reward, cfg.rollout.max_new_tokens),
        steps,
        cfg.rollout.mesh.tensor,
    )
    return RunSpec(rollout, learner_spec(cfg, credit, steps), recorder_spec(cfg, credit, steps), steps)
