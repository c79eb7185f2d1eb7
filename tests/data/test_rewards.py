"""Answer extraction, the killable math-verify pool, and reward shaping on real cases."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from comppo_jax.data.rewards import (
    RewardCoefficients,
    Verdict,
    VerifierPool,
    extract_answer,
    length_penalty,
    reasoning_format_ok,
    score_responses,
    terminal_reward_tokens,
)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=2, timeout_s=3.0) as pool:
        yield pool


@pytest.mark.parametrize(
    "text,answer",
    [
        ("Let me think.\nAnswer: 42", "42"),
        ("first try\nAnswer: 3\nwait, fix\nAnswer: $\\frac{1}{2}$", "\\frac{1}{2}"),  # the last Answer: line
        ("so \\boxed{\\frac{3}{4}} is it", "\\frac{3}{4}"),
        ("\\boxed{1} no, \\boxed{x^{2}+1}", "x^{2}+1"),  # nested braces, the last box
        ("Answer: \\boxed{7}", "7"),
        ("I do not know", None),
        ("unclosed \\boxed{12", None),
    ],
)
def test_answer_extraction(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "text,ok",
    [
        ("no tags", True),
        ("<think>a</think> Answer: 1", True),
        ("<think>a Answer: 1", False),
        ("</think><think>", False),
        ("<think>a</think><think>b</think>", False),
    ],
)
def test_reasoning_format(text, ok):
    assert reasoning_format_ok(text) is ok


def test_rewards_on_a_table_of_real_cases(pool):
    cases = [  # (response, gold, expected verdict, expected reward)
        ("<think>half</think>\nAnswer: 0.5", "\\frac{1}{2}", Verdict.CORRECT, 1.0),
        ("Answer: \\dfrac{1}{2}", "1/2", Verdict.CORRECT, 1.0),
        ("so \\boxed{2\\sqrt{2}}", "\\sqrt{8}", Verdict.CORRECT, 1.0),
        ("Answer: 1+x", "x+1", Verdict.CORRECT, 1.0),
        ("Answer: 3", "4", Verdict.INCORRECT, 0.0),
        ("I think it's four.", "4", Verdict.NO_ANSWER, 0.0),
        ("<think>unclosed\nAnswer: 4", "4", Verdict.CORRECT, -0.5),  # malformed tags
        ("Answer: 9^{9^{9^{9}}}", "1", Verdict.TIMEOUT, 0.0),  # the verifier would run for minutes
    ]
    rewards, verdicts, metrics = score_responses(
        [c[0] for c in cases], [c[1] for c in cases], [10] * len(cases), pool, RewardCoefficients(format_coef=0.5)
    )
    assert verdicts == [c[2] for c in cases]
    np.testing.assert_allclose(rewards, [c[3] for c in cases])
    assert metrics["reward/timeout"] == 1 and metrics["reward/malformed"] == 1 and metrics["reward/correct"] == 5
    # The pool survives the killed worker.
    assert pool.check([("2", "2")]) == [Verdict.CORRECT]


def test_a_verifier_worker_dying_on_an_answer_costs_that_reward_alone_and_is_counted():
    with VerifierPool(num_workers=1, timeout_s=60.0) as dying:
        threading.Timer(1.0, os.kill, (dying._pool._workers[0].pid, signal.SIGKILL)).start()  # the OOM killer
        rewards, verdicts, metrics = score_responses(
            ["Answer: 9^{9^{9^{9}}}", "Answer: 2"], ["1", "2"], [10, 10], dying
        )
        assert verdicts == [Verdict.DIED, Verdict.CORRECT]
        np.testing.assert_allclose(rewards, [0.0, 1.0])
        assert metrics["reward/died"] == 1 and metrics["reward/error"] == 0
        assert dying.check([("3", "3")]) == [Verdict.CORRECT]  # its replacement verifies


def test_length_penalty_only_for_correct_well_formed_and_clipped(pool):
    responses = ["Answer: 4", "Answer: 5", "<think>x\nAnswer: 4"]
    rewards, _, _ = score_responses(
        responses, ["4"] * 3, [100, 100, 100], pool, RewardCoefficients(format_coef=2.0, length_coef=0.001)
    )
    np.testing.assert_allclose(rewards, [0.9, 0.0, -1.0])


def test_a_correct_answer_never_scores_below_an_incorrect_one_unless_configured(pool):
    """The paper's final 8e-5 per token at a 16K budget: 1 - 8e-5 * 16384 = -0.31 unfloored."""
    responses = ["Answer: 4", "Answer: 4", "Answer: 5", "<think>x\nAnswer: 4"]
    lengths = [12_000, 16_384, 16_384, 100]
    floored = RewardCoefficients(format_coef=0.2, length_coef=8e-5)
    rewards, _, _ = score_responses(responses, ["4"] * 4, lengths, pool, floored)
    np.testing.assert_allclose(rewards, [0.04, 0.0, 0.0, -0.2], atol=1e-6)
    literal = RewardCoefficients(format_coef=0.2, length_coef=8e-5, correct_never_below_incorrect=False)
    rewards, _, _ = score_responses(responses, ["4"] * 4, lengths, pool, literal)
    np.testing.assert_allclose(rewards, [0.04, 1 - 8e-5 * 16384, 0.0, -0.2], atol=1e-6)
    assert rewards[1] < rewards[3]  # below a malformed one: what the floor prevents


def test_overlong_penalty_ramps_over_the_last_buffer_tokens():
    coefficients = RewardCoefficients(
        length_coef=1.0, length_penalty="overlong", max_length=16384, overlong_buffer=4096
    )
    np.testing.assert_allclose(length_penalty([100, 12288, 14336, 16384], coefficients), [0.0, 0.0, 0.5, 1.0])
    half = RewardCoefficients(length_coef=0.375, length_penalty="overlong", max_length=40, overlong_buffer=10)
    np.testing.assert_allclose(length_penalty([30, 35, 40], half), [0.0, 0.1875, 0.375])
    with pytest.raises(ValueError, match=r"overlong_buffer=50 must be in \(0, max_length=40\]"):
        length_penalty([1], RewardCoefficients(length_penalty="overlong", max_length=40, overlong_buffer=50))
    with pytest.raises(ValueError, match="length_penalty='cubic'"):
        length_penalty([1], RewardCoefficients(length_penalty="cubic"))


def test_overlong_rewards_stay_at_or_above_incorrect(pool):
    coefficients = RewardCoefficients(
        length_coef=1.0, length_penalty="overlong", max_length=16384, overlong_buffer=4096
    )
    rewards, _, _ = score_responses(["Answer: 4"] * 3, ["4"] * 3, [1000, 14336, 16384], pool, coefficients)
    np.testing.assert_allclose(rewards, [1.0, 0.5, 0.0])


def test_dapo_overlong_shaping_charges_every_response(pool):
    """length_penalty_on="all": incorrect and malformed responses pay the overlong penalty too (DAPO)."""
    responses = ["Answer: 4", "Answer: 5", "<think>unclosed\nAnswer: 4"]
    lengths = [16384, 16384, 14336]
    shaping = dict(length_coef=1.0, length_penalty="overlong", max_length=16384, overlong_buffer=4096, format_coef=0.5)
    paper, _, _ = score_responses(responses, ["4"] * 3, lengths, pool, RewardCoefficients(**shaping))
    dapo, _, _ = score_responses(
        responses, ["4"] * 3, lengths, pool, RewardCoefficients(**shaping, length_penalty_on="all")
    )
    np.testing.assert_allclose(paper, [0.0, 0.0, -0.5])
    np.testing.assert_allclose(dapo, [0.0, -1.0, -1.0])  # correct: max(1 - 1, 0); incorrect 0 - 1; malformed -0.5 - 0.5
    with pytest.raises(ValueError, match=r"length_penalty_on='some'; expected one of \('correct', 'all'\)"):
        score_responses(responses, ["4"] * 3, lengths, pool, RewardCoefficients(**shaping, length_penalty_on="some"))


def test_terminal_reward_sits_at_the_last_valid_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(
        terminal_reward_tokens([1.0, -0.5, 1.0], mask), [[0, 0, 1, 0], [-0.5, 0, 0, 0], [0, 0, 0, 0]]
    )


def test_mismatched_lengths_are_named(pool):
    with pytest.raises(ValueError, match=r"responses \(2\), golds \(1\)"):
        score_responses(["a", "b"], ["1"], [1, 1], pool)
