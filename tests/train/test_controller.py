"""The phase controller driven by synthetic metric streams: every rule and transition."""

from __future__ import annotations

import math

import pytest

from comppo_jax.train.controller import KNOBS, ControllerConfig, RewardSchedule, initial_state, knobs, target_phase, update

CONFIG = ControllerConfig()
CALM = dict(clip_fraction=0.01, ppo_kl=0.001, kl_loss=0.1, grad_norm=1.0, entropy=9.0)


def run(stream, config=CONFIG, state=None):
    state = initial_state() if state is None else state
    phases = []
    for metrics in stream:
        state = update(state, {**CALM, **metrics}, config)
        phases.append(int(state["phase"]))
    return state, phases


def test_emas_use_the_paper_coefficients():
    state, _ = run([dict(clip_fraction=0.0), dict(clip_fraction=1.0)])
    assert state["ema_clip_fraction"] == pytest.approx(0.4)
    state, _ = run([dict(entropy=10.0), dict(entropy=5.0)])
    assert state["ema_entropy"] == pytest.approx(0.2 * 5 + 0.8 * 10)


@pytest.mark.parametrize(
    "metrics,phase",
    [
        (dict(entropy=7.9), 1), (dict(entropy=7.4), 2), (dict(entropy=6.0), 3),
        (dict(clip_fraction=0.14), 1), (dict(clip_fraction=0.18), 2), (dict(clip_fraction=0.25), 3),
        (dict(ppo_kl=0.08), 1), (dict(ppo_kl=0.12), 2), (dict(ppo_kl=0.22), 3),
        (dict(kl_loss=2.85), 1), (dict(kl_loss=3.2), 2), (dict(kl_loss=4.0), 3),
        (dict(grad_norm=40.0), 1), (dict(grad_norm=80.0), 2), (dict(grad_norm=1e6), 2),
        (dict(response_clip_ratio=0.65), 3), (dict(response_clip_ratio=0.64), 0),
    ],
)
def test_each_rule_requests_its_phase(metrics, phase):
    state = update(initial_state(), {**CALM, **metrics}, CONFIG)  # first EMA value = the value
    assert target_phase(state, {**CALM, **metrics}, CONFIG) == phase


def test_dev_accuracy_drop_from_the_running_best():
    state, _ = run([dict(dev_accuracy=0.60)])
    for accuracy, phase in ((0.57, 0), (0.55, 1), (0.51, 2), (0.39, 3)):
        assert target_phase(state, {**CALM, "dev_accuracy": accuracy}, CONFIG) == phase


def test_entropy_drop_counts_only_when_clip_or_kl_is_in_warning():
    falling = [dict(entropy=16.0)] * 4 + [dict(entropy=e) for e in (15.0, 14.0, 13.0, 12.0)]
    state, _ = run(falling)
    assert 1.5 <= 16.0 - state["ema_entropy"] < 3.0  # the oldest four of the window against the EMA
    assert target_phase(state, CALM, CONFIG) == 0
    state["ema_clip_fraction"] = 0.15  # clip fraction in warning territory: the drop now counts
    assert target_phase(state, CALM, CONFIG) == 2


def test_escalation_needs_two_consecutive_triggers_and_takes_the_milder_target():
    _, phases = run([dict(response_clip_ratio=0.7), dict(), dict(response_clip_ratio=0.7)])
    assert phases == [0, 0, 0]  # not consecutive
    _, phases = run([dict(response_clip_ratio=0.7)] * 2)
    assert phases == [0, 3]
    _, phases = run([dict(dev_accuracy=0.6), dict(response_clip_ratio=0.7), dict(dev_accuracy=0.55)])
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


def test_knobs_per_phase_and_the_stable_warm_in():
    state = initial_state()
    assert knobs(state, 0, CONFIG) == {name: (int(v[0]) if name == "actor_epochs" else v[0]) for name, v in KNOBS.items()}
    assert knobs(state, 25, CONFIG)["clip"] == pytest.approx(0.20)
    assert knobs(state, 32.5, CONFIG)["clip"] == pytest.approx(0.18)
    assert knobs(state, 100, CONFIG)["kl_multiplier"] == pytest.approx(1.75)
    state["phase"] = 3.0
    hard = knobs(state, 100, CONFIG)
    assert (hard["kl_multiplier"], hard["clip"], hard["actor_epochs"], hard["advantage_clip"]) == (3.5, 0.09, 1, 2.5)


def test_disabled_controller_stays_stable():
    config = ControllerConfig(enabled=False)
    state, phases = run([dict(ppo_kl=1.0)] * 5, config=config)
    assert phases == [0] * 5 and knobs(state, 100, config)["clip"] == 0.20


def test_reward_schedule():
    schedule = RewardSchedule()
    assert schedule.at(0) == (pytest.approx(0.2), 0.0)
    assert schedule.at(20) == (pytest.approx(0.6), pytest.approx(3e-5))
    assert schedule.at(40) == (pytest.approx(1.0), pytest.approx(5.5e-5))
    assert schedule.at(100) == (pytest.approx(1.0), pytest.approx(8e-5))
    assert all(not math.isnan(v) for v in initial_state().values() if v == v) and initial_state()["phase"] == 0
