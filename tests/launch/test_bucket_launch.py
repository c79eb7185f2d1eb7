"""The launchers a user runs, on a gs:// run directory (the GCS emulator on 127.0.0.1): train, a
refused second launch, a resume, then eval, export and report reading the run from the bucket and
writing their outputs there."""

from __future__ import annotations

import json

import pytest
from conftest import CPU_ONLY_ENV, launch_script, small_train_flags

from comppo_jax import storage


def launch(emulator, *args):
    return launch_script(*args, env={**CPU_ONLY_ENV, **emulator.env})


@pytest.mark.slow
def test_train_resume_eval_export_and_report_on_a_bucket(gcs_emulator, bucket, tmp_path):
    run = f"{bucket}/runs/tiny"
    trained = launch(gcs_emulator, "launch/train.py", *small_train_flags(run))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"outputs in {run}; best checkpoint" in trained.stdout
    last = json.loads(storage.read_text(f"{run}/summary.json"))["steps"]

    refused = launch(gcs_emulator, "launch/train.py", *small_train_flags(run))
    assert refused.returncode == 1 and f"{run} already has checkpoints" in refused.stderr

    resumed = launch(gcs_emulator, "launch/train.py", *small_train_flags(run, steps=3), "--config.resume=True")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line)["step"] for line in storage.read_lines(f"{run}/metrics.jsonl")]
    assert rows == list(range(1, last + 2))

    evaluated = launch(gcs_emulator, "launch/eval.py", f"--checkpoint={run}", "--step=latest")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads(storage.read_text(f"{run}/eval/step_{last + 1}/results.json"))
    assert results["checkpoint"] == run and [row["set"] for row in results["rows"]] == ["id_dev"]

    exported = launch(gcs_emulator, "launch/export.py", f"--run={run}", "--step=latest", f"--out={bucket}/export")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert {"config.json", "model.safetensors"} <= set(storage.names(f"{bucket}/export"))

    reported = launch(gcs_emulator, "launch/report.py", f"--run={run}")
    assert reported.returncode == 0, reported.stderr[-3000:]
    page = storage.read_text(f"{run}/report.html")
    assert run in page and "Where the credit went" in page
