"""DAPO's dynamic sampling: which groups are kept, refilled and merged, and what it reports."""

from __future__ import annotations

import numpy as np
import pytest

from comppo_jax.data.rewards import Verdict
from comppo_jax.rollout import Generation
from comppo_jax.rollout.experience import DynamicSamplingExhausted, Sampled, dynamic_sampling, take_groups

GROUP = 2


def fake_sampled(rewards, prompt_width: int, tag: str, correct=None) -> Sampled:
    """A batch of len(rewards) / GROUP prompts; every array identifies its row (`tag` + index).
    Verdicts: `correct` per row (default: reward > 0)."""
    rows = len(rewards)
    response = 3
    tokens = np.arange(rows * (prompt_width + response)).reshape(rows, -1).astype(np.int32) + 1
    generation = Generation(
        tokens,
        np.ones(tokens.shape, bool),
        np.full(rows, prompt_width, np.int32),
        tokens[:, prompt_width:],
        np.ones((rows, response), bool),
        np.zeros((rows, response), np.float32),
    )
    rewards = np.asarray(rewards, np.float32)
    correct = rewards > 0 if correct is None else correct
    verdicts = [Verdict.CORRECT if c else Verdict.INCORRECT for c in correct]
    return Sampled(
        generation,
        [f"{tag}{g}" for g in range(rows // GROUP)],
        [f"{tag}{r}" for r in range(rows)],
        rewards,
        verdicts,
        {"reward/correct": float((rewards > 0).sum()), "reward/mean": float(rewards.mean())},
        np.ones((rows, response), bool),
        np.tile(rewards[:, None], (1, response)),
        np.full(rows, tokens.shape[1], np.int32),
    )


def test_take_groups_keeps_whole_groups_in_order_and_pads_the_narrower_batch():
    wide, narrow = fake_sampled([1, 0, 1, 1], 5, "a"), fake_sampled([0, 1, 0, 0], 2, "b")
    merged = take_groups([(wide, [1]), (narrow, [0, 1])], GROUP)
    assert merged.problems == ["a1", "b0", "b1"] and merged.texts == ["a2", "a3", "b0", "b1", "b2", "b3"]
    np.testing.assert_array_equal(merged.rewards, [1, 1, 0, 1, 0, 0])
    assert merged.generation.tokens.shape == (6, 8)  # the wide batch's prompt 5 + response 3
    np.testing.assert_array_equal(merged.generation.tokens[2], np.r_[narrow.generation.tokens[0], 0, 0, 0])
    np.testing.assert_array_equal(merged.generation.attention_mask[2], [True] * 5 + [False] * 3)
    np.testing.assert_array_equal(merged.generation.response_tokens[:2], wide.generation.response_tokens[2:])


def test_dynamic_sampling_refills_dropped_groups_from_later_batches():
    first = fake_sampled([1, 1, 0, 1, 0, 0], 4, "a")  # groups: all-equal, informative, all-equal
    later = [fake_sampled([0, 0, 1, 0, 1, 1], 4, "b"), fake_sampled([1, 0, 0, 1, 1, 1], 4, "c")]
    draws = []

    def draw(round_index):
        draws.append(round_index)
        return later[round_index - 1]

    batch = dynamic_sampling(first, draw, GROUP, max_refills=3)
    assert draws == [1, 2]  # one informative group per batch until three
    assert batch.problems == ["a1", "b1", "c0"]
    metrics = batch.reward_metrics
    assert metrics["dynamic_sampling/refills"] == 2 and metrics["dynamic_sampling/uninformative_kept"] == 0
    assert metrics["dynamic_sampling/dropped_fraction"] == pytest.approx(
        5 / 9
    )  # c1 and c2 count too: they were sampled
    assert metrics["reward/correct"] == 3 + 3 + 4 and metrics["reward/mean"] == pytest.approx(10 / 18)


def test_dynamic_sampling_stops_at_the_refill_cap_and_fills_with_dropped_groups():
    first = fake_sampled([1, 1, 0, 1, 0, 0], 4, "a")
    draws = []
    batch = dynamic_sampling(
        first, lambda r: draws.append(r) or fake_sampled([1, 1, 1, 1, 0, 0], 4, "b"), GROUP, max_refills=1
    )
    assert draws == [1]
    # Informative first (a1), then the earliest dropped groups (a0, a2) keep the batch at three prompts, in order.
    assert batch.problems == ["a0", "a1", "a2"] and batch.reward_metrics["dynamic_sampling/uninformative_kept"] == 2
    assert dynamic_sampling(first, None, GROUP, max_refills=0).problems == [
        "a0",
        "a1",
        "a2",
    ]  # no refill: nothing drawn


def test_an_informative_first_batch_is_kept_as_it_is():
    first = fake_sampled([1, 0, 0, 1], 4, "a")
    batch = dynamic_sampling(first, None, GROUP, max_refills=3)
    assert batch.problems == first.problems and batch.reward_metrics["dynamic_sampling/dropped_fraction"] == 0.0
    np.testing.assert_array_equal(batch.generation.tokens, first.generation.tokens)


def test_the_accuracy_filter_reads_verdicts_and_the_reward_filter_shaped_rewards():
    """DAPO's filter drops an all-correct group whose length shaping made its rewards differ, and keeps
    a group with one correct answer whose shaped reward fell to the wrong answer's."""
    # Group 0: both correct, rewards 0.9 / 1.0 (shaped); group 1: one correct at reward 0, one wrong at 0.
    first = fake_sampled([0.9, 1.0, 0.0, 0.0], 4, "a", correct=[True, True, True, False])
    assert (
        dynamic_sampling(first, None, GROUP, max_refills=0).reward_metrics["dynamic_sampling/uninformative_kept"] == 1
    )
    by_accuracy = dynamic_sampling(first, None, GROUP, max_refills=0, filter_by="accuracy")
    by_reward = dynamic_sampling(first, None, GROUP, max_refills=0, filter_by="reward")
    # Each filter keeps its informative group first, then fills with the dropped one, in group order.
    assert by_accuracy.problems == by_reward.problems == ["a0", "a1"]
    refill = lambda r: fake_sampled([0.0, 0.0, 0.0, 0.0], 4, "b", correct=[True, False, True, True])
    assert dynamic_sampling(first, refill, GROUP, max_refills=1, filter_by="accuracy").problems == ["a1", "b0"]
    assert dynamic_sampling(first, refill, GROUP, max_refills=1, filter_by="reward").problems == ["a0", "a1"]
    with pytest.raises(ValueError, match="dynamic_sampling_filter='length'"):
        dynamic_sampling(first, None, GROUP, max_refills=0, filter_by="length")


def test_until_full_draws_until_the_batch_is_full_and_stops_after_a_pass_over_the_prompts():
    first = fake_sampled([1, 1, 0, 0], 4, "a")  # two uninformative groups
    informative_after = {3: fake_sampled([1, 0, 0, 1], 4, "d")}
    draws = []

    def draw(round_index):
        draws.append(round_index)
        return informative_after.get(round_index, fake_sampled([0, 0, 0, 0], 4, f"r{round_index}"))

    batch = dynamic_sampling(first, draw, GROUP, max_refills=-1, train_prompts=10)  # 5 rounds of 2 prompts make a pass
    assert draws == [1, 2, 3] and batch.problems == ["d0", "d1"]
    assert (
        batch.reward_metrics["dynamic_sampling/refills"] == 3
        and batch.reward_metrics["dynamic_sampling/uninformative_kept"] == 0
    )
    draws.clear()
    with pytest.raises(
        DynamicSamplingExhausted, match="drew 2 rounds of 2 prompts .* 4 training prompts, and found 0 of the 2"
    ):
        dynamic_sampling(first, draw, GROUP, max_refills=-1, train_prompts=4)
    assert draws == [1]
