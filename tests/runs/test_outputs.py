"""What a run writes: config.json read back as the config that ran, curves.png's panels (labels, the
warm-start point, legends clear of the data)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
from matplotlib.figure import Figure

from comppo_jax import storage
from comppo_jax.models import load_config_file
from comppo_jax.runs.outputs import (
    AGAINST_THE_OUTCOME,
    METRICS_FILE,
    PANELS,
    MetricsWriter,
    one_outcome,
    plot_run,
    read_metrics,
)
from comppo_jax.train.schema import load_run_config, save_run_config
from comppo_jax.train.validation import validate_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("preset", ["tiny.py", "qwen3_4b.py"])
def test_run_config_reads_back_as_the_config_that_ran(tmp_path, preset):
    config = load_config_file(os.path.join(REPO, "configs", preset))
    config.train.actor_lr = 3e-6  # an override, as from the command line
    save_run_config(config, str(tmp_path))
    loaded = load_run_config(str(tmp_path))
    assert loaded.to_dict() == config.to_dict()  # tuples stay tuples (JSON has only lists)
    assert loaded.controller.warm_in_steps == config.controller.warm_in_steps and isinstance(
        loaded.controller.warm_in_steps, tuple
    )
    if preset == "tiny.py":  # the presets' model.path must name a real checkpoint directory
        validate_config(loaded)


def test_configs_run_py_gives_a_runs_config_with_command_line_overrides_on_top(tmp_path, monkeypatch):
    """--config=configs/run.py:<output_dir> (launch/eval.py's way to override the run's own config)."""
    from absl import flags
    from ml_collections import config_flags

    config = load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    config.data.dev_size = 7
    save_run_config(config, str(tmp_path))
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values)
    argv = ["eval.py", f"--config={REPO}/configs/run.py:{tmp_path}", "--config.eval.samples=3"]
    monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides from sys.argv
    values(argv)
    assert values.config.eval.samples == 3 and values.config.data.dev_size == 7
    assert {**values.config.to_dict(), "eval": None} == {**config.to_dict(), "eval": None}


def test_a_run_written_before_a_field_existed_gets_its_default_and_keeps_its_own_values(tmp_path):
    """An older run's config.json lacks the fields added since; they take the template's defaults, so
    --config.eval.temperature=... and evaluation work on it, and nothing it recorded changes."""
    config = load_config_file(os.path.join(REPO, "configs", "tiny.py"))
    config.train.loss_aggregation = "seq-mean-token-sum"
    save_run_config(config, str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    del written["eval"]["temperature"], written["eval"]["top_p"], written["train"]["kl_aggregation"]
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded = load_run_config(str(tmp_path))
    assert (loaded.eval.temperature, loaded.eval.top_p, loaded.train.kl_aggregation) == (1.0, 0.7, "token-mean")
    assert loaded.to_dict() == config.to_dict() and loaded.train.loss_aggregation == "seq-mean-token-sum"


def test_run_config_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/config.json does not exist.*output_dir"):
        load_run_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{tmp_path}/config.json is not valid JSON"):
        load_run_config(str(tmp_path))


def test_curves_label_every_axis_start_accuracy_at_the_warm_start_and_keep_legends_off_the_data(tmp_path, monkeypatch):
    rows = [
        {
            "step": step,
            "reward/mean": 0.1 * step,
            "kl_loss": 0.01,
            "clip_fraction": 0.02,
            "entropy": 0.5,
            "grad_norm": 1.0,
            **({"dev_accuracy": 0.5 + 0.01 * step} if step % 2 == 0 else {}),
        }
        for step in range(1, 9)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    saved = []
    savefig = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda figure, *args, **kwargs: (saved.append(figure), savefig(figure, *args, **kwargs))
    )
    plot_run(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png"), title="t", warm_start_accuracy=0.4)
    (figure,) = saved
    figure.canvas.draw()
    axes = figure.axes[: len(PANELS)]
    assert all(axis.get_ylabel() and axis.get_xlabel() for axis in axes)
    accuracy = next(axis for axis in axes if axis.get_title().startswith("dev accuracy"))
    (line,) = accuracy.lines
    np.testing.assert_array_equal(line.get_xdata(), [0, 2, 4, 6, 8])
    assert line.get_ydata()[0] == 0.4
    for axis in axes:
        legend = axis.get_legend()
        if legend is not None:  # entirely below the plotting area
            assert legend.get_window_extent().y1 <= axis.get_window_extent().y0


def written_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_a_resume_sets_torn_and_later_rows_aside_and_keeps_the_rest(tmp_path, caplog):
    """A crash mid-write leaves a torn last line; rows past the checkpoint are the steps the
    resumed run does again. Neither stops the resume: both go, verbatim, to a named file."""
    rows = [json.dumps({"step": step, "reward/mean": step / 10}) for step in range(1, 6)]
    (tmp_path / METRICS_FILE).write_text("\n".join(rows) + '\n{"step": 6, "reward/me')
    writer = MetricsWriter(str(tmp_path), resumed_step=3, loggers=("jsonl",))
    writer.write({"step": 4, "reward/mean": 0.0})
    writer.close()
    assert [row["step"] for row in written_rows(tmp_path)] == [1, 2, 3, 4]
    aside = tmp_path / f"{METRICS_FILE}.set_aside_at_step_3"
    assert aside.read_text().splitlines() == rows[3:] + ['{"step": 6, "reward/me']
    assert f"3 line(s) that do not parse or lie past the resumed step 3 set aside into {aside}" in caplog.text


def test_a_resume_without_its_metrics_file_warns_naming_the_missing_steps(tmp_path, caplog):
    writer = MetricsWriter(str(tmp_path), resumed_step=9, loggers=("jsonl",))
    writer.close()
    assert "no rows for step(s) 1-9 of the 9 the run resumes after (the file is missing)" in caplog.text
    (tmp_path / METRICS_FILE).write_text("\n".join(json.dumps({"step": s}) for s in (1, 2, 5, 6)) + "\n")
    MetricsWriter(str(tmp_path), resumed_step=7, loggers=("jsonl",)).close()
    assert "no rows for step(s) 3-4, 7 of the 7 the run resumes after (lost)" in caplog.text
    assert [row["step"] for row in written_rows(tmp_path)] == [1, 2, 5, 6]


def test_a_new_run_sets_an_earlier_attempts_rows_aside_instead_of_truncating_them(tmp_path, caplog):
    """A run that stopped before its first checkpoint starts again as a new run: its rows are kept aside."""
    rows = [json.dumps({"step": step}) for step in (1, 2)]
    (tmp_path / METRICS_FILE).write_text("\n".join(rows) + "\n")
    MetricsWriter(str(tmp_path), loggers=("jsonl",)).close()
    assert written_rows(tmp_path) == []
    assert (tmp_path / f"{METRICS_FILE}.set_aside_at_step_0").read_text().splitlines() == rows
    assert "set aside into" in caplog.text


def test_wandb_offline_logs_under_the_run_directory_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # in the test extra; the wandb extra for users
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_id = lambda: (tmp_path / "wandb_run_id").read_text().strip()
    writer = MetricsWriter(str(tmp_path), loggers=("jsonl", "wandb"), config={"method": "comppo"})
    writer.write({"step": 1, "reward/mean": 0.5, "phase": "stable", "sample": {"response": "x"}})
    writer.close()
    first = run_id()
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{first}/run-{first}.wandb"))) == 1
    MetricsWriter(str(tmp_path), resumed_step=1, loggers=("jsonl", "wandb")).close()
    assert run_id() == first  # the resume's W&B run is the run's own
    MetricsWriter(str(tmp_path), resumed_step=0, loggers=("jsonl", "wandb")).close()
    assert run_id() != first  # a new run in the directory starts its own


def test_on_a_bucket_rows_appear_at_each_flush_and_a_resume_sets_later_rows_aside_there(bucket, caplog):
    """A bucket has no appends: rows reach metrics.jsonl at each flush (TensorBoard: an event file per
    flush); a resume's torn and later rows are set aside in the bucket as on a disk."""
    run = f"{bucket}/run"
    writer = MetricsWriter(run, loggers=("jsonl", "tensorboard"))
    writer.write({"step": 1, "reward/mean": 0.5})
    assert storage.read_lines(f"{run}/{METRICS_FILE}") == []
    writer.flush()
    writer.write({"step": 2, "reward/mean": 0.25})
    writer.write({"step": 3, "reward/mean": 0.75})
    writer.close()
    assert [json.loads(line)["step"] for line in storage.read_lines(f"{run}/{METRICS_FILE}")] == [1, 2, 3]
    assert len(storage.names(f"{run}/tensorboard")) == 2

    storage.write_text(f"{run}/{METRICS_FILE}", storage.read_text(f"{run}/{METRICS_FILE}") + '{"step": 4, "rew')
    MetricsWriter(run, resumed_step=2, loggers=("jsonl",)).close()
    assert [json.loads(line)["step"] for line in storage.read_lines(f"{run}/{METRICS_FILE}")] == [1, 2]
    aside = storage.read_lines(f"{run}/{METRICS_FILE}.set_aside_at_step_2")
    assert [line[:10] for line in aside] == ['{"step": 3', '{"step": 4']


def test_the_recorder_flushes_every_row_before_a_checkpoint_save_starts(bucket):
    """So a preemption never loses a checkpointed step's row, on a bucket where rows wait for a flush."""
    from comppo_jax.train.recorder import Recorder

    run, seen = f"{bucket}/run", []

    class Checkpoints:
        def save(self, step, state, meta, dev_accuracy):
            seen.append([json.loads(line)["step"] for line in storage.read_lines(f"{run}/{METRICS_FILE}")])

    recorder = Recorder.__new__(Recorder)  # only what checkpoint() reads
    recorder.spec = SimpleNamespace(checkpoint_every=10)
    recorder.checkpoints, recorder.meta, recorder.last_step = Checkpoints(), {}, 100
    recorder.writer = MetricsWriter(run, loggers=("jsonl",))
    for step in (1, 2):
        recorder.writer.write({"step": step})
        recorder.checkpoint(step, {}, {}, {}, stopping=True)
    assert seen == [[1], [1, 2]]


def test_readers_drop_the_exploded_explained_variance_of_runs_logged_before_its_check(tmp_path):
    """A committed VAPO run logged -1.4e14 for a batch of equal returns: the curves and the run page read no EV
    there, and keep every other number of the row."""
    from comppo_jax.eval.run_report import metrics_rows

    path = tmp_path / METRICS_FILE
    logged = [
        {"step": 1, "critic/explained_variance": -141654198644111.78, "critic/value_mae": 0.1},
        {"step": 2, "critic/explained_variance": -3.5, "credit/outcome_explained_variance": -2e13},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in logged))
    expected = [{"step": 1, "critic/value_mae": 0.1}, {"step": 2, "critic/explained_variance": -3.5}]
    assert read_metrics(str(path)) == expected
    assert metrics_rows(str(path)) == (expected, 0)


def test_readers_drop_what_a_step_of_one_outcome_logged_against_it(tmp_path):
    """Runs before the recorder left them out logged outcome EVs down to -181498 on steps whose responses were all
    right (outcomes differing by the length penalty alone): readers drop the three fields measured against the
    outcome there, keep them on a step with a right and a wrong response, and keep the rest of every row."""
    against = {"credit/outcome_explained_variance": -520.0, "credit/outcome_spearman": 0.1}
    against["credit/early_sign_agreement"] = 0.4
    counts = {"reward/correct": 64.0, "reward/incorrect": 0.0, "reward/malformed": 0.0, "reward/mean": 0.99}
    mixed = {**counts, "reward/correct": 63.0, "reward/incorrect": 1.0}
    all_malformed = {**counts, "reward/correct": 0.0, "reward/incorrect": 64.0, "reward/malformed": 64.0}
    some_malformed = {**all_malformed, "reward/malformed": 3.0}
    rows = [counts, mixed, all_malformed, some_malformed]
    path = tmp_path / METRICS_FILE
    path.write_text(
        "".join(
            json.dumps({"step": i, **row, **against, "credit/trace_horizon": 2.0}) + "\n" for i, row in enumerate(rows)
        )
    )
    kept = [set(AGAINST_THE_OUTCOME) <= set(row) for row in read_metrics(str(path))]
    assert kept == [False, True, False, True]
    assert all(row["credit/trace_horizon"] == 2.0 and "reward/mean" in row for row in read_metrics(str(path)))
    assert not one_outcome({"step": 1})  # a row without reward counts says nothing of its outcomes
