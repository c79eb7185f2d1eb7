"""Position-only gate control: binning, fit, lookup, save/load and bad files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from comppo_jax.credit import (
    PositionSchedule,
    apply_position_schedule,
    fit_position_schedule,
    load_position_schedule,
    position_bins,
    save_position_schedule,
)


def test_bins_follow_relative_position_with_exact_edges():
    lengths = np.array([20, 40, 7, 1, 0])
    mask = np.arange(40)[None] < lengths[:, None]
    bins = np.asarray(position_bins(mask, 20))
    # t/T in (k/20, (k+1)/20] -> bin k; T = 20 puts token t in bin t - 1.
    np.testing.assert_array_equal(bins[0, :20], np.arange(20))
    np.testing.assert_array_equal(bins[1, :40], np.arange(40) // 2)
    # T = 7: t/T = 1/7 .. 1 -> ceil(20 t / 7) - 1.
    np.testing.assert_array_equal(bins[2, :7], [2, 5, 8, 11, 14, 17, 19])
    assert bins[3, 0] == 19  # a single token is at t/T = 1
    assert np.all(bins[~mask] == 0)
    # Position counts valid tokens only (non-contiguous masks).
    gap = np.array([[1, 0, 1, 1]], bool)
    np.testing.assert_array_equal(position_bins(gap, 3), [[0, 0, 1, 2]])


def test_fit_recovers_bin_means_over_several_batches():
    rng = np.random.default_rng(0)
    truth = np.linspace(0.2, 0.8, 20)
    batches, masks = [], []
    for width in (40, 100):
        lengths = rng.integers(20, width + 1, 8)
        mask = np.arange(width)[None] < lengths[:, None]
        kappa = truth[np.asarray(position_bins(mask, 20))] + rng.normal(0, 1e-3, mask.shape)
        batches.append(np.where(mask, kappa, 5.0).astype(np.float32))  # padding junk is ignored
        masks.append(mask)
    schedule = fit_position_schedule(batches, masks, metadata={"run": "unit"})
    assert schedule.n_bins == 20 and schedule.metadata == {"run": "unit"}
    np.testing.assert_allclose(schedule.mean_gate, truth, atol=2e-3)
    assert schedule.token_counts.sum() == sum(m.sum() for m in masks)
    np.testing.assert_allclose(schedule.bin_edges, np.linspace(0, 1, 21))


def test_fit_fills_empty_bins_with_the_global_mean():
    mask = np.array([[1, 1, 0, 0]], bool)  # T = 2 fills bins 9 and 19 of 20 only
    kappa = np.array([[0.2, 0.6, 0.0, 0.0]], np.float32)
    schedule = fit_position_schedule(kappa, mask)
    assert schedule.token_counts[9] == 1 and schedule.token_counts[19] == 1 and schedule.token_counts.sum() == 2
    assert schedule.mean_gate[9] == pytest.approx(0.2) and schedule.mean_gate[19] == pytest.approx(0.6)
    assert schedule.mean_gate[0] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="no valid token"):
        fit_position_schedule(kappa, np.zeros_like(mask))
    with pytest.raises(ValueError, match=r"mask\[0\] has shape \(1, 3\) but kappa\[0\] has shape \(1, 4\)"):
        fit_position_schedule(kappa, mask[:, :3])
    with pytest.raises(ValueError, match="one mask per kappa batch"):
        fit_position_schedule([kappa, kappa], [mask])


def test_apply_looks_up_the_schedule():
    schedule = PositionSchedule(np.arange(20) / 40.0, np.ones(20, np.int64))
    mask = np.arange(12)[None] < np.array([[10], [12], [0]])
    kappa = np.asarray(apply_position_schedule(schedule, mask))
    bins = np.asarray(position_bins(mask, 20))
    np.testing.assert_allclose(kappa, np.where(mask, bins / 40.0, 0.0), rtol=1e-6)
    assert kappa.dtype == np.float32


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    mask = np.arange(50)[None] < rng.integers(20, 51, 6)[:, None]
    schedule = fit_position_schedule(rng.uniform(0.1, 0.9, mask.shape), mask, metadata={"source": "run-7", "step": 300})
    path = tmp_path / "schedule.json"
    save_position_schedule(schedule, path)
    record = json.loads(path.read_text())
    assert record["format"] == "comppo_jax.position_schedule" and record["n_bins"] == 20
    assert len(record["bin_edges"]) == 21
    loaded = load_position_schedule(path)
    np.testing.assert_array_equal(loaded.mean_gate, schedule.mean_gate)
    np.testing.assert_array_equal(loaded.token_counts, schedule.token_counts)
    assert loaded.metadata == {"source": "run-7", "step": 300}
    np.testing.assert_array_equal(apply_position_schedule(loaded, mask), apply_position_schedule(schedule, mask))


def _good_record():
    return {
        "format": "comppo_jax.position_schedule",
        "version": 1,
        "n_bins": 2,
        "bin_edges": [0.0, 0.5, 1.0],
        "mean_gate": [0.3, 0.6],
        "token_counts": [4, 5],
        "metadata": {},
    }


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("mean_gate"), "missing field 'mean_gate'"),
        (lambda r: r.update(format="npz"), "field 'format'"),
        (lambda r: r.update(version=2), "field 'version' must be 1"),
        (lambda r: r.update(n_bins="2"), "field 'n_bins' must be int"),
        (lambda r: r.update(bin_edges=[0.0, 0.4, 1.0]), "field 'bin_edges' must be 2 equal-width bins"),
        (lambda r: r.update(mean_gate=[0.3]), "field 'mean_gate' must have 2 entries"),
        (lambda r: r.update(mean_gate=[0.3, 1.5]), "field 'mean_gate' must hold gates in"),
        (lambda r: r.update(mean_gate=[0.3, "x"]), "field 'mean_gate' holds a bad entry"),
        (lambda r: r.update(token_counts=[4, -1]), "field 'token_counts' must be non-negative"),
        (lambda r: r.update(token_counts=[4, 1.5]), "field 'token_counts' holds a bad entry"),
        (lambda r: r.update(metadata=[]), "field 'metadata' must be dict"),
    ],
)
def test_bad_files_name_the_path_and_the_field(tmp_path, edit, message):
    record = _good_record()
    edit(record)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=re.escape(str(path))) as info:
        load_position_schedule(path)
    assert message in str(info.value)


def test_non_json_file_is_refused(tmp_path):
    path = tmp_path / "schedule.json"
    path.write_text("not json {")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a JSON file")):
        load_position_schedule(path)
    path.write_text(json.dumps(_good_record()))
    assert load_position_schedule(path).n_bins == 2
