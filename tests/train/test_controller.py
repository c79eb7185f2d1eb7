"""The phase controller driven by metric streams: every rule and transition, both threshold
options, a healthy Qwen3-4B-scale trace and one trace per pathology, and the reward schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ml_collections import config_dict

from comppo_jax.train.controller import (
    KNOBS,
    THRESHOLDS,
    ControllerConfig,
    RewardSchedule,
    config_section,
    controller_config,
    initial_state,
    knobs,
    reward_schedule,
    target_phase,
    update,
)
from comppo_jax.train.schema import paper_config

CALIBRATED = ControllerConfig()
LITERAL = ControllerConfig(**THRESHOLDS["paper_literal"])
# Quiet signals at the scale of a healthy LM run (token-mean nats, token-mean k3, ...).
CALM = dict(clip_fraction=0.05, ppo_kl=0.003, kl_loss=0.003, grad_norm=3.0, entropy=0.6)
CALM_LITERAL = {**CALM, "entropy": 9.0, "kl_loss": 0.1}


def run(stream, config=CALIBRATED, state=None, calm=CALM):
    state = initial_state() if state is None else state
    phases = []
    for metrics in stream:
        state = update(state, {**calm, **metrics}, config)
        phases.append(int(state["phase"]))
    return state, phases


def section(**fields):
    out = config_section()
    out.update(fields)
    return out


def test_emas_use_the_paper_coefficients():
    state, _ = run([dict(clip_fraction=0.0), dict(clip_fraction=1.0)])
    assert state["ema_clip_fraction"] == pytest.approx(0.4)
    state, _ = run([dict(entropy=1.0), dict(entropy=0.5)])
    assert state["ema_entropy"] == pytest.approx(0.2 * 0.5 + 0.8 * 1.0)


@pytest.mark.parametrize(
    "metrics,phase",
    [
        (dict(clip_fraction=0.14), 1),
        (dict(clip_fraction=0.18), 2),
        (dict(clip_fraction=0.25), 3),
        (dict(ppo_kl=0.08), 1),
        (dict(ppo_kl=0.12), 2),
        (dict(ppo_kl=0.22), 3),
        (dict(kl_loss=0.05), 1),
        (dict(kl_loss=0.1), 2),
        (dict(kl_loss=0.2), 3),
        (dict(kl_loss=0.049), 0),
        (dict(grad_norm=40.0), 1),
        (dict(grad_norm=80.0), 2),
        (dict(grad_norm=1e6), 2),
        (dict(response_clip_ratio=0.65), 3),
        (dict(response_clip_ratio=0.64), 0),
    ],
)
def test_each_rule_requests_its_phase(metrics, phase):
    state = update(initial_state(), {**CALM, **metrics}, CALIBRATED)  # first EMA value = the value
    assert target_phase(state, {**CALM, **metrics}, CALIBRATED) == phase


@pytest.mark.parametrize(
    "metrics,phase",
    [
        (dict(entropy=7.9), 1),
        (dict(entropy=7.4), 2),
        (dict(entropy=6.0), 3),
        (dict(entropy=0.6), 3),
        (dict(kl_loss=2.85), 1),
        (dict(kl_loss=3.2), 2),
        (dict(kl_loss=4.0), 3),
        (dict(kl_loss=0.2), 0),
    ],
)
def test_paper_literal_rules_read_the_printed_numbers(metrics, phase):
    state = update(initial_state(), {**CALM_LITERAL, **metrics}, LITERAL)
    assert target_phase(state, {**CALM_LITERAL, **metrics}, LITERAL) == phase


def test_entropy_rule_is_relative_to_the_runs_baseline():
    state, _ = run([dict(entropy=e) for e in (0.9, 1.1, 1.0, 1.0, 1.0)])  # baseline: mean of the first 5 = 1.0
    for ema, phase in ((0.41, 0), (0.39, 1), (0.26, 1), (0.24, 2), (0.16, 2), (0.14, 3)):
        assert target_phase({**state, "ema_entropy": ema}, CALM, CALIBRATED) == phase
    # The same ratios at another scale (the tiny model's entropy, a tenfold smaller one).
    small, _ = run([dict(entropy=0.1)] * 5)
    assert target_phase({**small, "ema_entropy": 0.039}, CALM, CALIBRATED) == 1
    # Silent until the baseline exists: a near-zero entropy in the first steps requests nothing.
    early, _ = run([dict(entropy=0.6)] * 4)
    assert target_phase({**early, "ema_entropy": 0.01}, CALM, CALIBRATED) == 0
    # The baseline is the first steps' mean and stays fixed afterwards.
    later, _ = run([dict(entropy=0.2)] * 20, state=state)
    assert later["entropy_baseline_sum"] == state["entropy_baseline_sum"]


def test_entropy_drop_counts_only_when_clip_or_kl_is_in_warning():
    falling = [dict(entropy=1.0)] * 4 + [dict(entropy=e) for e in (0.8, 0.7, 0.6, 0.5)]
    state, _ = run(falling)
    drop = (1.0 - state["ema_entropy"]) / 1.0  # the oldest four of the window against the EMA
    assert 0.1875 <= drop < 0.375
    assert target_phase(state, CALM, CALIBRATED) == 0
    state["ema_clip_fraction"] = 0.15  # clip fraction in warning territory: the drop now counts
    assert target_phase(state, CALM, CALIBRATED) == 2
    # paper_literal: drops in nats (1.5 / 3.0).
    literal, _ = run(
        [dict(entropy=16.0)] * 4 + [dict(entropy=e) for e in (15.0, 14.0, 13.0, 12.0)],
        config=LITERAL,
        calm=CALM_LITERAL,
    )
    literal["ema_clip_fraction"] = 0.15
    assert 1.5 <= 16.0 - literal["ema_entropy"] < 3.0 and target_phase(literal, CALM_LITERAL, LITERAL) == 2


def test_dev_accuracy_drop_from_the_running_best_holds_until_the_next_evaluation():
    state, _ = run([dict(dev_accuracy=0.60)])
    for accuracy, phase in ((0.57, 0), (0.55, 1), (0.51, 2), (0.39, 3)):
        evaluated = update(state, {**CALM, "dev_accuracy": accuracy}, CALIBRATED)
        assert target_phase(evaluated, CALM, CALIBRATED) == phase  # the steps after the evaluation too
    # Evaluations 10 steps apart: one bad evaluation escalates on the next step.
    stream = [dict(dev_accuracy=0.6)] + [dict()] * 9 + [dict(dev_accuracy=0.5)] + [dict()] * 3
    _, phases = run(stream)
    assert phases[10] == 0 and phases[11] == 2


def test_escalation_needs_two_consecutive_triggers_and_takes_the_milder_target():
    _, phases = run([dict(response_clip_ratio=0.7), dict(), dict(response_clip_ratio=0.7)])
    assert phases == [0, 0, 0]  # not consecutive
    _, phases = run([dict(response_clip_ratio=0.7)] * 2)
    assert phases == [0, 3]
    _, phases = run([dict(dev_accuracy=0.6), dict(dev_accuracy=0.55, response_clip_ratio=0.7), dict()])
    assert phases == [0, 0, 1]  # targets hard-stop then warning: escalate to warning


def test_deescalation_one_phase_after_five_clear_steps():
    state, phases = run([dict(ppo_kl=1.0)] * 2 + [dict(ppo_kl=0.0)] * 30)
    assert phases[1] == 3
    first_drop = phases.index(2)
    assert phases[first_drop - 5 : first_drop] == [3] * 5
    assert phases[-1] == 0 and sorted(set(phases)) == [0, 1, 2, 3]
    # A non-clear step resets the count.
    _, phases = run([dict(ppo_kl=1.0)] * 2 + [dict(ppo_kl=0.0)] * 4 + [dict(ppo_kl=1.0)] + [dict(ppo_kl=0.0)] * 3)
    assert 2 not in phases


def test_knobs_per_phase_and_the_phase0_drift_choice():
    state = initial_state()
    stable = {name: (int(v[0]) if name == "actor_epochs" else v[0]) for name, v in KNOBS.items()}
    assert knobs(state, 0, CALIBRATED) == stable
    assert knobs(state, 100, CALIBRATED) == stable  # "none": the stable phase keeps the stable knobs
    drift = ControllerConfig(phase0_drift="warning")  # the literal reading
    assert knobs(state, 25, drift)["clip"] == pytest.approx(0.20)
    assert knobs(state, 32.5, drift)["clip"] == pytest.approx(0.18)
    assert (
        knobs(state, 100, drift)["kl_multiplier"] == pytest.approx(1.75)
        and knobs(state, 100, drift)["actor_epochs"] == 2
    )
    state["phase"] = 3.0
    hard = knobs(state, 100, CALIBRATED)
    assert (hard["kl_multiplier"], hard["clip"], hard["actor_epochs"], hard["advantage_clip"]) == (3.5, 0.09, 1, 2.5)


def test_disabled_controller_stays_stable():
    config = ControllerConfig(enabled=False, phase0_drift="warning")
    state, phases = run([dict(ppo_kl=1.0)] * 5, config=config)
    assert phases == [0] * 5 and knobs(state, 100, config)["clip"] == 0.20


def healthy_trace(steps: int = 200, seed: int = 0, eval_every: int = 10) -> list[dict]:
    """A healthy Qwen3-4B run's signals: entropy 0.3-1.0 nats token-mean, slowly falling; k3 rising
    1e-4 -> 1e-2; PPO KL 1e-3-1e-2; clip fraction 0.02-0.1; grad norm 1-10; a few truncated
    responses; dev accuracy rising with evaluation noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps) / steps
    trace = []
    for i in range(steps):
        metrics = dict(
            entropy=float(np.clip(0.8 - 0.35 * t[i] + rng.normal(0, 0.08), 0.3, 1.0)),
            kl_loss=float(np.clip(1e-4 * 100 ** t[i] * rng.lognormal(0, 0.3), 1e-4, 1e-2)),
            ppo_kl=float(np.exp(rng.uniform(np.log(1e-3), np.log(1e-2)))),
            clip_fraction=float(rng.uniform(0.02, 0.1)),
            grad_norm=float(np.exp(rng.uniform(0, np.log(10)))),
            response_clip_ratio=float(rng.uniform(0, 0.2)),
        )
        if (i + 1) % eval_every == 0:
            metrics["dev_accuracy"] = float(0.5 + 0.1 * t[i] + rng.uniform(-0.015, 0.015))
        trace.append(metrics)
    return trace


def preset_controller(**fields) -> ControllerConfig:
    """The Qwen3-4B / Llama presets' controller (their shared paper section), with overrides."""
    cfg = paper_config({})
    cfg.controller.update(fields)
    return controller_config(cfg.controller)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_run_stays_stable_under_the_presets_controller(seed):
    _, phases = run(healthy_trace(seed=seed), config=preset_controller(), calm={})
    assert phases == [0] * 200


def test_the_literal_thresholds_would_hold_a_healthy_run_in_hard_stop():
    """Why `calibrated` is the default: appendix C's entropy numbers read as token-mean nats."""
    _, phases = run(healthy_trace(), config=preset_controller(thresholds="paper_literal"), calm={})
    assert phases.index(3) == 1 and phases.count(3) == 199


def with_pathology(start: int, **series) -> list[dict]:
    """The healthy trace with `series[name](step)` replacing that signal from `start` on."""
    trace = healthy_trace()
    for i in range(start, len(trace)):
        for name, value in series.items():
            if name != "dev_accuracy" or name in trace[i]:
                trace[i][name] = value(i - start)
    return trace


@pytest.mark.parametrize(
    "pathology,phase",
    [
        # entropy collapse: 0.6 -> 0.06 nats within 30 steps (below 15 % of the baseline): hard-stop
        (dict(entropy=lambda k: max(0.06, 0.6 * 0.9**k)), 3),
        # KL blow-up: the k3 to the reference climbs to 0.3: hard-stop
        (dict(kl_loss=lambda k: min(0.3, 0.01 * 1.3**k)), 3),
        # a moderate KL drift to 0.12: strong
        (dict(kl_loss=lambda k: min(0.12, 0.01 * 1.3**k)), 2),
        # clip-fraction spike to 0.3: hard-stop
        (dict(clip_fraction=lambda k: 0.3 if k < 10 else 0.05), 3),
        # clip fraction at 0.15: warning
        (dict(clip_fraction=lambda k: 0.15 if k < 10 else 0.05), 1),
        # dev accuracy falls 0.10 below its best: strong
        (dict(dev_accuracy=lambda k: 0.45), 2),
    ],
)
def test_each_pathology_escalates_to_its_documented_phase(pathology, phase):
    _, phases = run(with_pathology(100, **pathology), config=preset_controller(), calm={})
    assert phases[:100] == [0] * 100
    assert max(phases[100:]) == phase


def test_the_run_recovers_to_stable_after_a_transient():
    trace = with_pathology(100, clip_fraction=lambda k: 0.3 if k < 10 else 0.05)
    _, phases = run(trace, config=preset_controller(), calm={})
    assert phases[-1] == 0


def test_controller_config_options_and_overrides():
    assert controller_config(config_section()) == ControllerConfig()
    literal = controller_config(section(thresholds="paper_literal"))
    assert (literal.entropy_below, literal.kl_loss_at_least, literal.entropy_reference) == (
        (8.0, 7.5, 6.5),
        (2.85, 3.2, 4.0),
        "absolute",
    )
    assert controller_config(
        section(thresholds="paper_literal", kl_loss_at_least=(0.1, 0.2, 0.4))
    ).kl_loss_at_least == (0.1, 0.2, 0.4)
    assert controller_config(section(entropy_below=(None, None, None))).entropy_below == (None, None, None)
    with pytest.raises(ValueError, match="config.controller.thresholds='paper'"):
        controller_config(section(thresholds="paper"))
    with pytest.raises(ValueError, match="config.controller.phase0_drift='yes'"):
        controller_config(section(phase0_drift="yes"))
    with pytest.raises(ValueError, match=r"unknown fields \['entropy_blow'\]"):
        controller_config(config_dict.ConfigDict({**section().to_dict(), "entropy_blow": (1, 2, 3)}))


def test_presets_start_stable_with_the_calibrated_rules_and_no_drift():
    config = preset_controller()
    assert (config.entropy_reference, config.phase0_drift, config.enabled) == ("baseline", "none", True)
    assert int(initial_state()["phase"]) == 0


def test_reward_schedule():
    schedule = RewardSchedule()
    assert (schedule.at(0).format_coef, schedule.at(0).length_coef) == (pytest.approx(0.2), 0.0)
    assert (schedule.at(20).format_coef, schedule.at(20).length_coef) == (pytest.approx(0.6), pytest.approx(3e-5))
    assert (schedule.at(40).format_coef, schedule.at(40).length_coef) == (pytest.approx(1.0), pytest.approx(5.5e-5))
    assert (schedule.at(100).format_coef, schedule.at(100).length_coef) == (pytest.approx(1.0), pytest.approx(8e-5))


def test_the_initial_state_marks_exactly_the_unmeasured_signals_as_nan():
    """NaN means "not measured yet": the first value replaces it (`_ema`) and no rule fires on it. Every
    other entry starts at its number, so a counter or the phase starting at NaN fails here."""
    state = initial_state()
    unmeasured = {f"ema_{name}" for name in ("clip_fraction", "ppo_kl", "kl_loss", "grad_norm", "entropy")}
    unmeasured |= {f"entropy_{i}" for i in range(8)} | {"dev_drop"}
    assert {name for name, value in state.items() if math.isnan(value)} == unmeasured
    assert {name: value for name, value in state.items() if name not in unmeasured} == {
        "phase": 0.0,
        "up_count": 0.0,
        "down_count": 0.0,
        "pending_target": 0.0,
        "best_dev": -1.0,
        "entropy_seen": 0.0,
        "entropy_baseline_sum": 0.0,
    }
    assert target_phase(state, CALM, CALIBRATED) == 0


def test_a_run_without_a_kl_term_keeps_its_kl_rule_quiet():
    """DAPO logs no kl_loss: its EMA stays unmeasured and the other rules still act."""
    calm = {name: value for name, value in CALM.items() if name != "kl_loss"}
    state, phases = run([{}] * 3, calm=calm)
    assert (
        math.isnan(state["ema_kl_loss"]) and state["ema_clip_fraction"] == pytest.approx(0.05) and phases == [0, 0, 0]
    )
    _, phases = run([dict(clip_fraction=0.25)] * 3, calm=calm)
    assert phases[-1] == 3


def test_reward_schedule_of_a_config():
    reward = paper_config({}).reward
    assert reward_schedule(reward, 16384).at(100).length_penalty == "linear"
    reward.length_penalty = "overlong"
    overlong = reward_schedule(reward, 16384)
    at = overlong.at(100)
    assert (at.length_penalty, at.length_coef, at.max_length, at.overlong_buffer) == ("overlong", 1.0, 16384, 4096)
    assert overlong.at(20).length_coef == pytest.approx(3 / 8) and overlong.at(19).length_coef == 0.0
    reward.length_penalty_schedule = "constant"  # DAPO: the full penalty from the first step
    assert [reward_schedule(reward, 16384).at(step).length_coef for step in (0, 19, 100)] == [1.0, 1.0, 1.0]
    reward.length_penalty = "linear"
    assert [reward_schedule(reward, 16384).at(step).length_coef for step in (0, 100)] == [pytest.approx(8e-5)] * 2
    reward.length_penalty_schedule = "ramp"
    with pytest.raises(ValueError, match="config.reward.length_penalty_schedule='ramp'"):
        reward_schedule(reward, 16384)
    reward.length_penalty, reward.length_penalty_schedule = "overlong", "paper"
    reward.overlong_buffer = 20000
    with pytest.raises(
        ValueError, match=r"config.reward.overlong_buffer=20000 must be in \(0, rollout.max_new_tokens=16384\]"
    ):
        reward_schedule(reward, 16384)
    reward.length_penalty = "quadratic"
    with pytest.raises(ValueError, match="config.reward.length_penalty='quadratic'"):
        reward_schedule(reward, 16384)
