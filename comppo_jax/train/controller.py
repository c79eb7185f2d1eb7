"""The closed-loop phase controller and the reward schedule (paper appendix C, "Phase controller").

Four phases (stable, warning, strong, hard-stop) set the update knobs. Every step the
controller updates EMAs of its inputs, finds the most severe phase any rule requests (the
target), and moves with hysteresis: up after two consecutive steps whose target is above the
current phase, down one phase after five consecutive clear steps. On a run that starts in the
stable phase, steps 25-40 interpolate the stable knobs linearly to the warning knobs (and the
stable phase keeps the warning knobs after step 40: the paper's warm-in, read literally).

State is a flat dict of floats (Orbax- and JSON-friendly) and the update is plain Python: it
runs once per step on the host, outside jit.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

PHASES = ("stable", "warning", "strong", "hard_stop")
ENTROPY_WINDOW = 8

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


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """Thresholds for warning / strong / hard-stop (None: that level is not requested)."""

    entropy_below: tuple = (8.0, 7.5, 6.5)
    clip_fraction_at_least: tuple = (0.14, 0.18, 0.25)
    ppo_kl_at_least: tuple = (0.08, 0.12, 0.22)
    kl_loss_at_least: tuple = (2.85, 3.20, 4.00)
    grad_norm_at_least: tuple = (40.0, 80.0, None)
    dev_drop_at_least: tuple = (0.04, 0.08, 0.20)
    entropy_drop_at_least: tuple = (None, 1.5, 3.0)  # only while clip fraction or PPO KL is in warning
    response_clip_ratio_at_least: tuple = (None, None, 0.65)
    ema: float = 0.4  # clip fraction, PPO KL, KL loss, grad norm
    entropy_ema: float = 0.2
    escalate_after: int = 2
    deescalate_after: int = 5
    warm_in_steps: tuple = (25, 40)  # stable -> warning interpolation on runs that start stable
    enabled: bool = True


def initial_state() -> dict[str, float]:
    state = {"phase": 0.0, "started_stable": 1.0, "up_count": 0.0, "down_count": 0.0, "pending_target": 0.0,
             "best_dev": -1.0, "entropy_seen": 0.0}
    for name in ("clip_fraction", "ppo_kl", "kl_loss", "grad_norm", "entropy"):
        state[f"ema_{name}"] = float("nan")
    state.update({f"entropy_{i}": float("nan") for i in range(ENTROPY_WINDOW)})
    return state


def _ema(previous: float, value: float, coefficient: float) -> float:
    return value if previous != previous else coefficient * value + (1 - coefficient) * previous  # nan: first value


def _level(value: float, thresholds, *, below: bool = False) -> int:
    """Highest phase (1..3) whose threshold `value` reaches, 0 if none."""
    level = 0
    for phase, threshold in enumerate(thresholds, start=1):
        if threshold is not None and value == value and (value < threshold if below else value >= threshold):
            level = phase
    return level


def target_phase(state: Mapping[str, float], metrics: Mapping[str, float], config: ControllerConfig) -> int:
    """The most severe phase any rule requests, from the (already updated) EMAs and raw inputs."""
    clip_level = _level(state["ema_clip_fraction"], config.clip_fraction_at_least)
    kl_level = _level(state["ema_ppo_kl"], config.ppo_kl_at_least)
    levels = [
        _level(state["ema_entropy"], config.entropy_below, below=True),
        clip_level,
        kl_level,
        _level(state["ema_kl_loss"], config.kl_loss_at_least),
        _level(state["ema_grad_norm"], config.grad_norm_at_least),
        _level(metrics.get("response_clip_ratio", float("nan")), config.response_clip_ratio_at_least),
    ]
    if "dev_accuracy" in metrics and state["best_dev"] >= 0:
        levels.append(_level(state["best_dev"] - metrics["dev_accuracy"], config.dev_drop_at_least))
    window = [state[f"entropy_{i}"] for i in range(ENTROPY_WINDOW)]
    if state["entropy_seen"] >= ENTROPY_WINDOW and (clip_level or kl_level):
        oldest = sum(window[:4]) / 4  # the window is oldest first
        levels.append(_level(oldest - state["ema_entropy"], config.entropy_drop_at_least))
    return max(levels)


def update(state: Mapping[str, float], metrics: Mapping[str, float], config: ControllerConfig) -> dict[str, float]:
    """One step: metrics has clip_fraction, ppo_kl, kl_loss, grad_norm, entropy and optionally
    response_clip_ratio and dev_accuracy (when evaluated). Returns the new state."""
    state = dict(state)
    if not config.enabled:
        return state
    for name in ("clip_fraction", "ppo_kl", "kl_loss", "grad_norm"):
        state[f"ema_{name}"] = _ema(state[f"ema_{name}"], float(metrics[name]), config.ema)
    state["ema_entropy"] = _ema(state["ema_entropy"], float(metrics["entropy"]), config.entropy_ema)
    for i in range(ENTROPY_WINDOW - 1):
        state[f"entropy_{i}"] = state[f"entropy_{i + 1}"]
    state[f"entropy_{ENTROPY_WINDOW - 1}"] = float(metrics["entropy"])
    state["entropy_seen"] += 1

    target = target_phase(state, metrics, config)
    if "dev_accuracy" in metrics:
        state["best_dev"] = max(state["best_dev"], float(metrics["dev_accuracy"]))
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
    """The update knobs of the current phase (with the stable-phase warm-in)."""
    phase = int(state["phase"])
    values = {name: float(levels[phase]) for name, levels in KNOBS.items()}
    start, end = config.warm_in_steps
    if config.enabled and phase == 0 and state["started_stable"] and step >= start:
        t = min(1.0, (step - start) / (end - start))
        values = {name: (1 - t) * levels[0] + t * levels[1] for name, levels in KNOBS.items()}
        values["actor_epochs"] = KNOBS["actor_epochs"][0]
    values["actor_epochs"] = int(values["actor_epochs"])
    return values


@dataclasses.dataclass(frozen=True)
class RewardSchedule:
    """Format penalty 0.2 -> 1.0 over steps 0-40; length penalty from step 20, 3e-5 -> 8e-5 over 20-60."""

    format_coef: tuple = (0.2, 1.0, 0, 40)  # (start value, end value, start step, end step)
    length_coef: tuple = (3e-5, 8e-5, 20, 60)

    @staticmethod
    def _ramp(spec, step: int) -> float:
        start_value, end_value, start_step, end_step = spec
        if step < start_step:  # not enabled yet
            return 0.0
        t = min(1.0, (step - start_step) / max(end_step - start_step, 1))
        return start_value + t * (end_value - start_value)

    def at(self, step: int) -> tuple[float, float]:
        """(format_coef, length_coef) at `step`."""
        return self._ramp(self.format_coef, step), self._ramp(self.length_coef, step)
