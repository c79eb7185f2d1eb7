"""The closed-loop phase controller and the reward schedule (paper appendix C, "Phase controller").

Four phases (stable, warning, strong, hard-stop) set the update knobs. Every step the
controller updates EMAs of its inputs, finds the most severe phase any rule requests (the
target), and moves with hysteresis: up after two consecutive steps whose target is above the
current phase, down one phase after five consecutive clear steps. Runs start in the stable phase.
Dev accuracy arrives every `train.eval_every` steps; its drop from the running best holds until
the next evaluation (read only on the evaluated step, the rule could never fire twice in a row).

The signals, as comppo_jax.train.update computes them (each averaged over the step's minibatches
and epochs; the controller reads them only on steps that update the actor):

| signal | unit and aggregation | paper numbers (warning/strong/hard-stop) | used here ("calibrated") |
|---|---|---|---|
| entropy | nats, token-mean over response tokens | EMA < 8.0/7.5/6.5 | EMA < 0.40/0.25/0.15 x the run's baseline |
| entropy drop | oldest four's mean (8-step window) minus the EMA | none/1.5/3.0 nats | none/0.1875/0.375 of that mean |
| KL loss | k3 to the reference, token-mean | EMA >= 2.85/3.20/4.00 | EMA >= 0.05/0.10/0.20 |
| PPO KL | mean(old_logp - logp), token-mean | EMA >= 0.08/0.12/0.22 | the paper's |
| clip fraction | fraction of response tokens on the clipped branch | EMA >= 0.14/0.18/0.25 | the paper's |
| grad norm | global L2 norm of the actor gradient before clipping | EMA >= 40/80 (warning/strong) | the paper's |
| dev accuracy drop | running best minus this evaluation (fraction of problems) | >= 0.04/0.08/0.20 | the paper's |
| response-clip ratio | fraction of responses that reach rollout.max_new_tokens | >= 0.65 (hard-stop) | the paper's |

The paper does not state the units of its signals. Three of its numbers fit no sensible unit of
these metrics, so `thresholds="calibrated"` (the default) restates those rules:
- Entropy: a trained LM's token-mean entropy is far below 8 nats (ln 151936 = 11.9 is Qwen3's
  uniform maximum; healthy RL runs sit at 0.3-1.0), so the literal rule fires on every step. The
  calibrated rule compares the EMA with the mean of the run's first `entropy_baseline_steps`
  actor steps (the rule is silent until then): below 40 % of it is a collapse in progress,
  15 % a collapse (the entropy collapse DAPO reports ends close to zero). The drop rule keeps the paper's
  drops relative to its own warning level (1.5 / 8.0 and 3.0 / 8.0).
- KL loss: the token-mean k3 of a healthy run is 1e-4-1e-2, so 2.85 can never fire. The
  calibrated thresholds sit 5x above that range and next to the PPO-KL rule's scale.
`thresholds="paper_literal"` keeps the paper's numbers, read as the units above.

`phase0_drift` decides the paper's "on fresh phase-0 runs, steps 25-40 linearly interpolate
stable to warning knobs". Read literally ("warning"), the stable phase trains with the warning
knobs from step 40 on, so de-escalating to stable changes nothing and the screened launch
settings (actor LR, KL) are used for 40 of 200 steps. "none" (the default) keeps the stable
knobs in the stable phase: the settings a run is launched with are the ones it trains with while
it is healthy, and the controller changes them only when a rule fires.

State is a flat dict of floats (Orbax- and JSON-friendly) and the update is plain Python: it
runs once per step on the host, outside jit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ml_collections import config_dict

from comppo_jax.data.rewards import LENGTH_PENALTIES, RewardCoefficients

PHASES = ("stable", "warning", "strong", "hard_stop")
ENTROPY_WINDOW = 8
PHASE0_DRIFT = ("none", "warning")
ENTROPY_REFERENCES = ("baseline", "absolute")

# Knobs per phase (appendix C tables). KL and the actor LR are multipliers of the launch values
# (KL 0.0020 -> 0.0035 / 0.0045 / 0.0070 = x1.75 / 2.25 / 3.5; LR 1e-6 -> 7e-7 / 5e-7 / 2e-7).
KNOBS: dict[str, tuple[float, float, float, float]] = {
    "kl_multiplier": (1.0, 1.75, 2.25, 3.5),
    "clip": (0.20, 0.16, 0.14, 0.09),
    "actor_lr_multiplier": (1.0, 0.7, 0.5, 0.2),
    "value_clip": (0.5, 0.4, 0.3, 0.2),
    "critic_lr_multiplier": (1.0, 0.9, 0.7, 0.5),
    "advantage_clip": (5.0, 4.0, 3.5, 2.5),
    "actor_grad_clip": (1.0, 0.8, 0.7, 0.5),
    "critic_grad_clip": (1.0, 0.8, 0.7, 0.5),
    "actor_epochs": (2, 2, 2, 1),
}

# The rules whose numbers depend on the signals' units (module docstring), per named option.
THRESHOLDS: dict[str, dict] = {
    "calibrated": dict(
        entropy_reference="baseline",
        entropy_below=(0.40, 0.25, 0.15),
        entropy_drop_at_least=(None, 0.1875, 0.375),
        kl_loss_at_least=(0.05, 0.10, 0.20),
    ),
    "paper_literal": dict(
        entropy_reference="absolute",
        entropy_below=(8.0, 7.5, 6.5),
        entropy_drop_at_least=(None, 1.5, 3.0),
        kl_loss_at_least=(2.85, 3.20, 4.00),
    ),
}


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """Thresholds for warning / strong / hard-stop (None: that level is not requested).

    entropy_reference "baseline": `entropy_below` and `entropy_drop_at_least` are fractions of the
    run's baseline entropy and of the window's oldest four; "absolute": nats."""

    entropy_reference: str = "baseline"
    entropy_below: tuple = THRESHOLDS["calibrated"]["entropy_below"]
    entropy_drop_at_least: tuple = THRESHOLDS["calibrated"][
        "entropy_drop_at_least"
    ]  # only while clip fraction or PPO KL is in warning
    kl_loss_at_least: tuple = THRESHOLDS["calibrated"]["kl_loss_at_least"]
    clip_fraction_at_least: tuple = (0.14, 0.18, 0.25)
    ppo_kl_at_least: tuple = (0.08, 0.12, 0.22)
    grad_norm_at_least: tuple = (40.0, 80.0, None)
    dev_drop_at_least: tuple = (0.04, 0.08, 0.20)
    response_clip_ratio_at_least: tuple = (None, None, 0.65)
    entropy_baseline_steps: int = 5  # actor steps averaged into the baseline entropy
    ema: float = 0.4  # clip fraction, PPO KL, KL loss, grad norm
    entropy_ema: float = 0.2
    escalate_after: int = 2
    deescalate_after: int = 5
    phase0_drift: str = "none"  # "warning": the stable phase drifts to the warning knobs over warm_in_steps
    warm_in_steps: tuple = (25, 40)
    enabled: bool = True

    def __post_init__(self):
        if self.entropy_reference not in ENTROPY_REFERENCES:
            raise ValueError(
                f"config.controller.entropy_reference={self.entropy_reference!r}; expected one of {ENTROPY_REFERENCES}"
            )
        if self.phase0_drift not in PHASE0_DRIFT:
            raise ValueError(f"config.controller.phase0_drift={self.phase0_drift!r}; expected one of {PHASE0_DRIFT}")
        if self.entropy_baseline_steps < 1:
            raise ValueError(f"config.controller.entropy_baseline_steps={self.entropy_baseline_steps}; expected >= 1")


# One line per `controller` config field (launch/train.py --help); levels are warning / strong / hard-stop.
FIELD_HELP = {
    "thresholds": "calibrated (the entropy and KL-loss rules restated, comppo_jax.train.controller) | paper_literal",
    "entropy_reference": "baseline (entropy thresholds are fractions of the run's baseline) | absolute (nats)",
    "entropy_below": "entropy EMA below these per level (None: the thresholds option's)",
    "entropy_drop_at_least": "entropy drop over the 8-step window per level (None: the thresholds option's)",
    "kl_loss_at_least": "KL-loss EMA at least these per level (None: the thresholds option's)",
    "clip_fraction_at_least": "PPO clip-fraction EMA at least these per level",
    "ppo_kl_at_least": "PPO KL EMA at least these per level",
    "grad_norm_at_least": "actor grad-norm EMA at least these per level",
    "dev_drop_at_least": "dev-accuracy drop from the running best at least these per level",
    "response_clip_ratio_at_least": "fraction of responses reaching max_new_tokens at least these per level",
    "entropy_baseline_steps": "actor steps averaged into the baseline entropy",
    "ema": "EMA weight of clip fraction, PPO KL, KL loss and grad norm",
    "entropy_ema": "EMA weight of entropy",
    "escalate_after": "consecutive steps above the current phase before moving up",
    "deescalate_after": "consecutive clear steps before moving down one phase",
    "phase0_drift": "none (stable knobs stay) | warning (steps warm_in_steps drift them to the warning knobs)",
    "warm_in_steps": "the (first, last) step of phase0_drift's interpolation",
    "enabled": "False: the phase never changes",
}


def config_section() -> config_dict.ConfigDict:
    """The config's `controller` section: `thresholds` and every ControllerConfig field, those the
    option sets as typed placeholders (None: the option's value), so each is one flag away."""
    section = config_dict.ConfigDict({"thresholds": "calibrated"})
    for field in dataclasses.fields(ControllerConfig):
        if field.name in THRESHOLDS["calibrated"]:
            section[field.name] = config_dict.placeholder(type(field.default))
        else:
            section[field.name] = field.default
    return section


def controller_config(section) -> ControllerConfig:
    """The ControllerConfig of a config's `controller` section: the `thresholds` option's rules,
    then every field the section sets (None: keep the option's value)."""
    fields = dict(section)
    name = fields.pop("thresholds", "calibrated")
    if name not in THRESHOLDS:
        raise ValueError(f"config.controller.thresholds={name!r}; expected one of {tuple(THRESHOLDS)}")
    known = {f.name for f in dataclasses.fields(ControllerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"config.controller has unknown fields {unknown}; known: {sorted(known | {'thresholds'})}")
    return ControllerConfig(**{**THRESHOLDS[name], **{k: v for k, v in fields.items() if v is not None}})


def initial_state() -> dict[str, float]:
    state = {
        "phase": 0.0,
        "up_count": 0.0,
        "down_count": 0.0,
        "pending_target": 0.0,
        "best_dev": -1.0,
        "dev_drop": float("nan"),
        "entropy_seen": 0.0,
        "entropy_baseline_sum": 0.0,
    }
    for name in ("clip_fraction", "ppo_kl", "kl_loss", "grad_norm", "entropy"):
        state[f"ema_{name}"] = float("nan")
    state.update({f"entropy_{i}": float("nan") for i in range(ENTROPY_WINDOW)})
    return state


def _ema(previous: float, value: float, coefficient: float) -> float:
    return value if previous != previous else coefficient * value + (1 - coefficient) * previous  # nan: first value


def _level(value: float, thresholds, *, below: bool = False) -> int:
    """Highest phase (1..3) whose threshold `value` reaches, 0 if none (nan: 0)."""
    level = 0
    for phase, threshold in enumerate(thresholds, start=1):
        if threshold is not None and value == value and (value < threshold if below else value >= threshold):
            level = phase
    return level


def _fraction(value: float, reference: float) -> float:
    return value / reference if reference > 0 else float("nan")  # nan reference or 0 entropy: the rule is silent


def entropy_baseline(state: Mapping[str, float], config: ControllerConfig) -> float:
    """Mean entropy of the first `entropy_baseline_steps` steps (nan until they are seen)."""
    steps = config.entropy_baseline_steps
    return state["entropy_baseline_sum"] / steps if state["entropy_seen"] >= steps else float("nan")


def target_phase(state: Mapping[str, float], metrics: Mapping[str, float], config: ControllerConfig) -> int:
    """The most severe phase any rule requests, from the (already updated) EMAs and raw inputs."""
    clip_level = _level(state["ema_clip_fraction"], config.clip_fraction_at_least)
    kl_level = _level(state["ema_ppo_kl"], config.ppo_kl_at_least)
    relative = config.entropy_reference == "baseline"
    entropy = _fraction(state["ema_entropy"], entropy_baseline(state, config)) if relative else state["ema_entropy"]
    levels = [
        _level(entropy, config.entropy_below, below=True),
        clip_level,
        kl_level,
        _level(state["ema_kl_loss"], config.kl_loss_at_least),
        _level(state["ema_grad_norm"], config.grad_norm_at_least),
        _level(metrics.get("response_clip_ratio", float("nan")), config.response_clip_ratio_at_least),
        _level(state["dev_drop"], config.dev_drop_at_least),
    ]
    if state["entropy_seen"] >= ENTROPY_WINDOW and (clip_level or kl_level):
        oldest = sum(state[f"entropy_{i}"] for i in range(4)) / 4  # the window is oldest first
        drop = oldest - state["ema_entropy"]
        levels.append(_level(_fraction(drop, oldest) if relative else drop, config.entropy_drop_at_least))
    return max(levels)


def update(state: Mapping[str, float], metrics: Mapping[str, float], config: ControllerConfig) -> dict[str, float]:
    """One step: metrics has clip_fraction, ppo_kl, grad_norm, entropy and optionally kl_loss (a
    run with a KL term), response_clip_ratio and dev_accuracy (when evaluated). Returns the new state."""
    state = dict(state)
    if not config.enabled:
        return state
    for name in (
        "clip_fraction",
        "ppo_kl",
        "kl_loss",
        "grad_norm",
    ):  # no kl_loss without a KL term: its rule stays at level 0
        state[f"ema_{name}"] = _ema(state[f"ema_{name}"], float(metrics.get(name, float("nan"))), config.ema)
    entropy = float(metrics["entropy"])
    state["ema_entropy"] = _ema(state["ema_entropy"], entropy, config.entropy_ema)
    for i in range(ENTROPY_WINDOW - 1):
        state[f"entropy_{i}"] = state[f"entropy_{i + 1}"]
    state[f"entropy_{ENTROPY_WINDOW - 1}"] = entropy
    if state["entropy_seen"] < config.entropy_baseline_steps:
        state["entropy_baseline_sum"] += entropy
    state["entropy_seen"] += 1

    if "dev_accuracy" in metrics:  # the drop holds until the next evaluation, so it can persist
        accuracy = float(metrics["dev_accuracy"])
        state["dev_drop"] = state["best_dev"] - accuracy if state["best_dev"] >= 0 else float("nan")
        state["best_dev"] = max(state["best_dev"], accuracy)
    target = target_phase(state, metrics, config)
    phase = int(state["phase"])
    if target > phase:
        state["up_count"] += 1
        state["down_count"] = 0.0
        state["pending_target"] = target if state["up_count"] == 1 else min(state["pending_target"], target)
        if state["up_count"] >= config.escalate_after:
            state["phase"], state["up_count"] = float(state["pending_target"]), 0.0
    elif target < phase:
        state["down_count"] += 1
        state["up_count"] = 0.0
        if state["down_count"] >= config.deescalate_after:
            state["phase"], state["down_count"] = float(phase - 1), 0.0
    else:
        state["up_count"] = state["down_count"] = 0.0
    return state


def knobs(state: Mapping[str, float], step: int, config: ControllerConfig) -> dict[str, float]:
    """The update knobs of the current phase (and, with phase0_drift="warning", the stable
    phase's drift to the warning knobs over `warm_in_steps`)."""
    phase = int(state["phase"])
    values = {name: float(levels[phase]) for name, levels in KNOBS.items()}
    start, end = config.warm_in_steps
    if config.enabled and config.phase0_drift == "warning" and phase == 0 and step >= start:
        t = min(1.0, (step - start) / (end - start))
        values = {name: (1 - t) * levels[0] + t * levels[1] for name, levels in KNOBS.items()}
        values["actor_epochs"] = KNOBS["actor_epochs"][0]
    values["actor_epochs"] = int(values["actor_epochs"])
    return values


LENGTH_PENALTY_SCHEDULES = ("paper", "constant")


@dataclasses.dataclass(frozen=True)
class RewardSchedule:
    """The reward schedule (appendix C), applied in parallel with the phases: the format penalty
    ramps 0.2 -> 1.0 over steps 0-40; the length penalty is off before step 20 and ramps
    3e-5 -> 8e-5 per token over steps 20-60 (linear form). The overlong form ramps its full
    penalty the same way, 3/8 -> 1 of `overlong_penalty` (comppo_jax.data.rewards.length_penalty).
    `reward.length_penalty_schedule=constant` holds the length penalty at its end value from step 0.

    Specs are (start value, end value, start step, end step); `shaping` holds the unscheduled
    fields (the length penalty's form and the floor)."""

    format_coef: tuple = (0.2, 1.0, 0, 40)
    length_coef: tuple = (3e-5, 8e-5, 20, 60)
    shaping: RewardCoefficients = RewardCoefficients()

    @staticmethod
    def _ramp(spec, step: int) -> float:
        start_value, end_value, start_step, end_step = spec
        if step < start_step:  # not enabled yet
            return 0.0
        t = min(1.0, (step - start_step) / max(end_step - start_step, 1))
        return start_value + t * (end_value - start_value)

    def at(self, step: int) -> RewardCoefficients:
        """The shaping coefficients at `step`."""
        return dataclasses.replace(
            self.shaping, format_coef=self._ramp(self.format_coef, step), length_coef=self._ramp(self.length_coef, step)
        )


def reward_schedule(reward, max_new_tokens: int) -> RewardSchedule:
    """The schedule of a config's `reward` section for responses of at most `max_new_tokens`."""
    if reward.length_penalty not in LENGTH_PENALTIES:
        raise ValueError(f"config.reward.length_penalty={reward.length_penalty!r}; expected one of {LENGTH_PENALTIES}")
    if reward.length_penalty_schedule not in LENGTH_PENALTY_SCHEDULES:
        raise ValueError(
            f"config.reward.length_penalty_schedule={reward.length_penalty_schedule!r}; expected one of "
            f"{LENGTH_PENALTY_SCHEDULES}"
        )
    floor = reward.correct_never_below_incorrect
    scope = reward.length_penalty_on
    # "constant": the ramp's end value from step 0 (DAPO shapes overlong responses from the first step).
    held = lambda spec: (spec[1], spec[1], 0, 0) if reward.length_penalty_schedule == "constant" else spec
    if reward.length_penalty == "linear":
        return RewardSchedule(
            length_coef=held(RewardSchedule.length_coef),
            shaping=RewardCoefficients(correct_never_below_incorrect=floor, length_penalty_on=scope),
        )
    if not 0 < reward.overlong_buffer <= max_new_tokens:
        raise ValueError(
            f"config.reward.overlong_buffer={reward.overlong_buffer} must be in "
            f"(0, rollout.max_new_tokens={max_new_tokens}]"
        )
    if not 0 < reward.overlong_penalty:
        raise ValueError(f"config.reward.overlong_penalty={reward.overlong_penalty} must be > 0")
    penalty = reward.overlong_penalty
    shaping = RewardCoefficients(
        length_penalty="overlong",
        max_length=max_new_tokens,
        overlong_buffer=reward.overlong_buffer,
        correct_never_below_incorrect=floor,
        length_penalty_on=scope,
    )
    return RewardSchedule(length_coef=held((3 / 8 * penalty, penalty, 20, 60)), shaping=shaping)
