"""Gate, critic and outcome diagnostics against hand-computed values."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from comppo_jax.credit.registry import EstimatorSpec, realized_transport
from comppo_jax.runs.outputs import AGAINST_THE_OUTCOME
from comppo_jax.train.diagnostics import (
    NOTICE_AFTER_STEPS,
    blind_credit,
    critic_diagnostics,
    gate_statistics,
    outcome_diagnostics,
    outcome_reading,
    spearman,
)
from comppo_jax.train.recorder import Recorder


def test_gate_statistics_by_position_third_and_correctness():
    kappa = np.array([[0.1, 0.2, 0.3, 0.9, 0.9, 0.9], [0.5, 0.7, 0.6, 0.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], bool)
    stats = gate_statistics(kappa, mask, correct=[True, False])
    valid = [0.1, 0.2, 0.3, 0.9, 0.9, 0.9, 0.5, 0.7, 0.6]
    assert stats["gate/mean"] == pytest.approx(np.mean(valid))
    assert stats["gate/median"] == pytest.approx(0.6)
    assert stats["gate/iqr"] == pytest.approx(np.percentile(valid, 75) - np.percentile(valid, 25))
    # row 0 (T=6): thirds {0.1, 0.2}, {0.3, 0.9}, {0.9, 0.9}; row 1 (T=3): one token per third
    assert stats["gate/first_third"] == pytest.approx((0.1 + 0.2 + 0.5) / 3)
    assert stats["gate/middle_third"] == pytest.approx((0.3 + 0.9 + 0.7) / 3)
    assert stats["gate/last_third"] == pytest.approx((0.9 + 0.9 + 0.6) / 3)
    assert stats["gate/correct"] == pytest.approx(np.mean(kappa[0])) and stats["gate/incorrect"] == pytest.approx(0.6)
    assert "gate/incorrect" not in gate_statistics(kappa, mask, correct=[True, True])
    assert gate_statistics(kappa, np.zeros_like(mask), correct=[True, False]) == {}


def test_critic_diagnostics():
    mask = np.array([[1, 1, 1, 0]], bool)
    values = np.array([[0.2, 0.5, 1.0, 0.0]])
    returns = np.array([[0.4, 0.5, 0.7, 0.0]])
    rewards = np.array([[0.0, 0.0, 1.0, 0.0]])
    kappa = np.array([[0.5, 0.5, 0.5, 0.0]])
    stats = critic_diagnostics(values, returns, rewards, kappa, mask)
    v, g = values[0, :3], returns[0, :3]
    assert stats["critic/explained_variance"] == pytest.approx(1 - np.var(g - v) / np.var(g))
    assert stats["critic/value_mae"] == pytest.approx(np.mean(np.abs(v - g)))
    assert stats["critic/clamp_saturation"] == pytest.approx(1 / 3)  # |1.0| >= 0.99
    # TD targets r + kappa V' (V' = 0 past the end): 0.25, 0.5, 1.0 rank like V: Spearman 1
    assert stats["critic/td_spearman"] == pytest.approx(1.0)
    constant = critic_diagnostics(np.zeros((1, 4)), returns, rewards, kappa, mask)
    assert "critic/td_spearman" not in constant and "critic/explained_variance" in constant


def test_spearman_with_ties_is_scipys():
    from scipy import stats

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, 200).astype(float), rng.normal(size=200)  # x: many ties
    y[::3] = 0.5
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert spearman(x, -x) == pytest.approx(-1.0)


def test_equal_returns_up_to_rounding_report_no_explained_variance():
    """A batch with no correct response under lambda 1: returns equal up to float32 rounding once logged an
    explained variance of -1e13."""
    mask = np.ones((2, 3), bool)
    returns = np.float32(-0.3) + np.array([[0.0, 1e-8, 0.0], [3e-8, 0.0, 0.0]])
    values = np.array([[0.1, 0.2, 0.3], [0.0, -0.1, 0.2]])
    rewards = np.zeros((2, 3))
    stats = critic_diagnostics(values, returns, rewards, np.ones((2, 3)), mask)
    assert "critic/explained_variance" not in stats and "critic/value_mae" in stats
    terminal = np.zeros((2, 3))
    terminal[:, -1] = [-0.3, -0.3 + 3e-8]
    outcome = outcome_diagnostics(np.ones((2, 3)), values, terminal, np.ones((2, 3)), mask)
    assert "credit/outcome_explained_variance" not in outcome and "credit/outcome_spearman" not in outcome


# Two responses of 4 and 2 tokens, terminal rewards 1 and 0.
MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
REWARDS = np.array([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])


def test_outcome_diagnostics_by_hand():
    values = np.array([[0.2, 0.6, 0.4, 0.9], [0.5, 0.1, 7.0, 7.0]])  # 7.0: padding, never read
    advantages = np.array([[-0.5, 0.3, 0.2, 0.1], [0.4, -0.2, 9.0, 9.0]])
    transport = np.array([[0.5, 0.5, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]])
    stats = outcome_diagnostics(advantages, values, REWARDS, transport, MASK)
    v, r = np.array([0.2, 0.6, 0.4, 0.9, 0.5, 0.1]), np.array([1.0, 1, 1, 1, 0, 0])  # R_t: each response's outcome
    assert stats["credit/outcome_explained_variance"] == pytest.approx(1 - np.var(r - v) / np.var(r))
    # Ranks of V: 0.1 -> 1, 0.2 -> 2, 0.4 -> 3, 0.5 -> 4, 0.6 -> 5, 0.9 -> 6; of R: 0s -> 1.5, 1s -> 4.5.
    assert stats["credit/outcome_spearman"] == pytest.approx(
        np.corrcoef([2, 5, 3, 6, 4, 1], [4.5] * 4 + [1.5] * 2)[0, 1]
    )
    # First halves: tokens 0, 1 of row 0 (R - mean R = +0.5) and token 0 of row 1 (-0.5): signs -, +, + -> 1 of 3.
    assert stats["credit/early_sign_agreement"] == pytest.approx(1 / 3)
    # Row 0 keeps 1, 0.5, 0.25, 0.125 of its reward back from its end (>= 1/e: 2 tokens); row 1 keeps 1, 0.2 (1).
    assert stats["credit/trace_horizon"] == pytest.approx(1.5)


def test_a_constant_critic_ranks_nothing():
    stats = outcome_diagnostics(np.ones((2, 4)), np.zeros((2, 4)), REWARDS, np.ones((2, 4)), MASK)
    assert stats["credit/outcome_spearman"] == 0.0 and stats["credit/outcome_explained_variance"] == pytest.approx(0)


def test_outcome_diagnostics_without_a_critic_and_with_one_outcome():
    broadcast = np.array([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 0.0, 0.0]])
    stats = outcome_diagnostics(broadcast, None, REWARDS, np.ones((2, 4)), MASK)
    assert stats == {"credit/trace_horizon": 3.0, "credit/early_sign_agreement": 1.0}  # the whole response
    same = outcome_diagnostics(broadcast, None, np.zeros((2, 4)), np.ones((2, 4)), MASK)
    assert "credit/early_sign_agreement" not in same  # no response's outcome differs from the mean
    # A group of equal rewards gets no advantage (GRPO): its tokens are no disagreement.
    uniform_group = np.array([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    stats = outcome_diagnostics(uniform_group, None, REWARDS, np.ones((2, 4)), MASK)
    assert stats["credit/early_sign_agreement"] == 1.0


def test_each_estimators_transport_as_its_recursion_applies_it():
    kappa = np.array([[0.2, 0.4, 0.6, 0.8], [1.0, 0.5, 0.0, 0.0]])
    comp_gae = realized_transport(EstimatorSpec("comp_gae", lam=0.9), kappa, MASK)
    np.testing.assert_allclose(comp_gae, 0.9 * kappa)
    # Row 0 keeps 1, 0.54, 0.19 of its reward back from its end (2 tokens >= 1/e); row 1 keeps 1, 0.9 (2).
    assert outcome_diagnostics(np.ones((2, 4)), None, REWARDS, comp_gae, MASK)["credit/trace_horizon"] == 2.0
    # GAE with gamma 1: 0.95^k >= 1/e for k <= 19, so 20 tokens of a long response.
    long_mask = np.ones((1, 64), bool)
    gae = realized_transport(EstimatorSpec("gae", lam=0.95), None, long_mask)
    assert outcome_diagnostics(np.ones((1, 64)), None, np.eye(64)[-1:], gae, long_mask)["credit/trace_horizon"] == 20
    lengths_40_and_100 = np.arange(100)[None, :] < np.array([[40], [100]])
    vapo = realized_transport(EstimatorSpec("vapo", vapo_alpha=0.05), None, lengths_40_and_100)
    np.testing.assert_allclose(vapo[:, 0], [1 - 1 / (0.05 * 40), 1 - 1 / (0.05 * 100)])  # VAPO's own lambda
    assert (realized_transport(EstimatorSpec("grpo"), None, MASK) == 1).all()


BLIND = {"credit/outcome_explained_variance": 0.01, "credit/early_sign_agreement": 0.56, "credit/trace_horizon": 1.0}


def test_blind_credit_reads_both_signs_over_its_window_of_steps():
    assert blind_credit([BLIND] * NOTICE_AFTER_STEPS) and not blind_credit([BLIND] * (NOTICE_AFTER_STEPS - 1))
    # A run at chance swings from step to step (PPO at lambda 0.95 on the credit testbed: 0.2-0.8): the mean counts.
    swinging = [{**BLIND, "credit/early_sign_agreement": 0.2 + 0.6 * (i % 2)} for i in range(NOTICE_AFTER_STEPS)]
    assert blind_credit(swinging)
    knowing = {**BLIND, "credit/outcome_explained_variance": 0.3}
    assert not blind_credit([BLIND] * (NOTICE_AFTER_STEPS // 2) + [knowing] * (NOTICE_AFTER_STEPS // 2))
    signed = {**BLIND, "credit/early_sign_agreement": 0.95}  # PPO at lambda 1 there: 0.99
    assert not blind_credit([signed] * NOTICE_AFTER_STEPS)
    assert not blind_credit([{"credit/early_sign_agreement": 0.5}] * NOTICE_AFTER_STEPS)  # no critic: no notice


def test_the_recorder_says_once_that_early_credit_carries_no_outcome(caplog):
    """Over steps 1..25 of a critic that never learns the outcome: one warning, at step NOTICE_AFTER_STEPS."""
    recorder = SimpleNamespace(
        outcome_rows=[], noticed_blind_credit=False, main_process=True, spec=SimpleNamespace(output_dir="runs/x")
    )
    with caplog.at_level("WARNING"):
        for step in range(1, 26):
            Recorder.notice_blind_credit(recorder, step, {"step": step, "reward/mean": 0.2, **BLIND})
    notices = [r.getMessage() for r in caplog.records if "carry no outcome" in r.getMessage()]
    assert len(notices) == 1 and f"to step {NOTICE_AFTER_STEPS} " in notices[0]
    assert "python launch/report.py --run=runs/x" in notices[0]


def test_the_reading_says_what_the_critic_knows_and_where_credit_goes():
    knowing = {**BLIND, "credit/outcome_explained_variance": 0.4, "credit/outcome_spearman": 0.6}
    assert outcome_reading([BLIND] * 3 + [knowing] * 5) == (
        "Over the last 5 steps the critic explains 40% of the outcome (explained variance 0.40, Spearman 0.60); "
        "credit reaches the first half of a response with the outcome's sign 56% of the time; a final reward keeps "
        "1/e of itself over its response's last 1.0 tokens."
    )
    grpo = {"credit/early_sign_agreement": 0.9, "credit/trace_horizon": 30.0}
    assert outcome_reading([grpo]).startswith("Over the last 1 steps credit reaches")
    assert outcome_reading([{"reward/mean": 0.5}]) is None


def _step_metrics(reward_counts: dict, terminal: list[float]) -> dict:
    """The recorder's metrics of a step of two responses (MASK) with these terminal rewards and reward counts,
    through the function the loop calls; a critic whose values are the first response's outcome."""
    rewards = np.zeros((2, 4))
    rewards[0, 3], rewards[1, 1] = terminal
    kappa = np.full((2, 4), 0.5)
    sampled = SimpleNamespace(
        host_mask=MASK,
        reward_metrics=reward_counts,
        verdicts=[],
        reward_tokens=rewards,
    )
    learned = SimpleNamespace(
        scored=SimpleNamespace(rollout=SimpleNamespace(kappa=None), kappa=kappa),
        batch=SimpleNamespace(advantages=np.ones((2, 4)), old_values=np.full((2, 4), terminal[0]), returns=rewards),
        metrics={},
        gate_change=None,
        importance={},
    )
    recorder = SimpleNamespace(
        spec=SimpleNamespace(max_new_tokens=4, credit=SimpleNamespace(estimator=EstimatorSpec())),
        has_critic=True,
        warmup=0,
    )
    return Recorder.step_metrics(recorder, 1, SimpleNamespace(sampled=sampled, version=0), learned)


def test_a_step_the_policy_got_all_right_logs_nothing_against_the_outcome():
    """Both responses right, differing by the length penalty alone: an EV over that penalty's variance is no
    reading (-181498 on the decision testbed). A right and a wrong one: the fields are logged."""
    all_right = _step_metrics({"reward/correct": 2.0, "reward/incorrect": 0.0, "reward/malformed": 0.0}, [0.98, 0.99])
    assert "credit/trace_horizon" in all_right and not set(AGAINST_THE_OUTCOME) & set(all_right)
    mixed = _step_metrics({"reward/correct": 1.0, "reward/incorrect": 1.0, "reward/malformed": 0.0}, [0.98, 0.0])
    assert set(AGAINST_THE_OUTCOME) <= set(mixed)
