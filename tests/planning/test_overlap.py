"""The overlapped step's cost model: consistent with the decode floor, and the prediction the docs quote."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO

from comppo_jax.costs import chips, decode_floor
from comppo_jax.models import load_config_file, model_config
from comppo_jax.planning import overlap


def qwen3_4b():
    return model_config(load_config_file(f"{REPO}/configs/qwen3_4b.py").model)


def test_every_row_at_the_limit_decodes_in_the_decode_floor_of_its_best_group():
    config, chip = qwen3_4b(), chips.CHIPS["v5p"]
    seconds, group = overlap.rollout_seconds(config, chip, 8, np.full(16, 16384), 512)
    floors = decode_floor.floors(
        config,
        chip,
        8,
        num_prompts=4,
        samples=4,
        prompt_length=512,
        max_new_tokens=16384,
        page_size=64,
        decode_slots=None,
    )
    best = min(floors, key=lambda f: f.seconds)
    assert group == best.tensor and seconds == pytest.approx(best.seconds, rel=0.02)


def test_long_tailed_lengths_are_mostly_short_with_a_few_at_the_limit():
    lengths = overlap.long_tail_lengths(16, 16384)
    assert lengths.max() == 16384 and (lengths == 16384).sum() == 1 and np.median(lengths) < 0.4 * 16384


def test_the_learner_halves_on_twice_the_chips_and_the_split_pays_the_longer_stage():
    config, chip = qwen3_4b(), chips.CHIPS["v5p"]
    batch = overlap.LearnerBatch(np.full(16, 16896), 16896)
    one = overlap.learner_seconds(config, chip, 4, batch, epochs=2)
    assert overlap.learner_seconds(config, chip, 8, batch, epochs=2) == pytest.approx(one / 2)
    split = overlap.Split(4, 4, rollout=10.0, learner=7.0, transfer=0.5)
    assert split.seconds == 10.5 and overlap.Split(0, 4, 10.0, 7.0, 0.0).seconds == 17.0


def test_qwen3_4b_at_16k_on_a_v5p_16_slice_overlaps_to_the_docs_quote_with_the_learner_at_peak():
    # docs/benchmarks.md quotes this prediction with the learner at peak FLOPs: 1.297x (1.39x calibrated on the
    # compiled programs).
    lengths = overlap.long_tail_lengths(16, 16384)
    results = overlap.splits(qwen3_4b(), chips.CHIPS["v5p"], 8, lengths, prompt_length=512, epochs=2)
    best = min(results[1:], key=lambda s: s.seconds)
    assert best.rollout_devices == 4 and results[0].seconds / best.seconds == pytest.approx(1.297, abs=0.001)
    rows = overlap.split_rows(results)
    assert rows[0][0] == "synchronous" and "(best)" in rows[4][0]


def test_the_packed_learner_computes_fewer_flops_than_the_padded_and_more_than_the_real_tokens():
    config, lengths = qwen3_4b(), overlap.long_tail_lengths(16, 16384)
    layout = lambda **options: overlap.LearnerBatch.of(lengths, 512, 16384, **options)
    padded, packed, skipping = layout(), layout(packed=True), layout(packed=True, segment_skip=True)
    assert padded.rows() == 16 and packed.rows() < 16
    real = padded.real_flops(config)
    assert real < skipping.forward_flops(config) < packed.forward_flops(config) < padded.forward_flops(config)
    # A sequence per row, nothing to pack: the packed layout computes what the padded one does.
    full = lambda **options: overlap.LearnerBatch.of(np.full(4, 16384), 512, 16384, **options)
    assert full(packed=True).forward_flops(config) == full().forward_flops(config) == full().real_flops(config)


def test_scoring_on_the_learners_chips_beats_moving_the_critics_features_at_16k():
    lengths = overlap.long_tail_lengths(16, 16384)
    best = lambda scoring: (
        min(
            overlap.splits(qwen3_4b(), chips.CHIPS["v5p"], 8, lengths, prompt_length=512, epochs=2, scoring=scoring)[
                1:
            ],
            key=lambda s: s.seconds,
        ).seconds
    )
    assert best("learner") < best("rollout")
    assert overlap.feature_bytes(qwen3_4b(), rows=16, length=16896) == pytest.approx(5.54e9, rel=0.01)


def test_a_calibrated_learner_scales_every_learner_term_and_leaves_the_rollout():
    lengths = overlap.long_tail_lengths(16, 16384)
    plain, scaled = (
        overlap.splits(qwen3_4b(), chips.CHIPS["v5p"], 8, lengths, prompt_length=512, epochs=2, learner_scale=scale)
        for scale in (1.0, 1.24)
    )
    for a, b in zip(plain, scaled):
        assert (
            b.learner == pytest.approx(1.24 * a.learner)
            and b.rollout == a.rollout
            and b.rollout_devices == a.rollout_devices
        )
