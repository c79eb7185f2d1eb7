"""A run whose output_dir is a gs:// bucket (the GCS emulator on 127.0.0.1): every file lands in the
bucket, a resume continues it, a second plain launch is refused, and nothing is written locally."""

from __future__ import annotations

import json
import os

import pytest
from conftest import small_train_config

from comppo_jax import storage
from comppo_jax.train import loop


def listing(root: str) -> dict[str, int]:
    """{path under root: size} of every object below `root`."""
    fs = storage._filesystem(storage.path(root))
    prefix = root[len("gs://") :]
    return {path[len(prefix) + 1 :]: info["size"] for path, info in fs.find(prefix, detail=True).items()}


def metric_steps(run: str) -> list[int]:
    return [json.loads(line)["step"] for line in storage.read_lines(f"{run}/metrics.jsonl")]


@pytest.mark.slow
def test_a_run_on_a_bucket_writes_there_resumes_and_refuses_a_second_launch(bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path written by mistake would land here
    run = f"{bucket}/runs/tiny"
    summary = loop.train(small_train_config(run, plot=True))
    files = listing(run)
    for name in (
        "config.json",
        "metrics.jsonl",
        "summary.json",
        "curves.png",
        "gate_profile.json",
        "reference_digests.json",
    ):
        assert name in files, name
    last = summary["steps"]  # the steps and the critic's warm-up
    assert any(name.startswith(f"checkpoints/{last}/") for name in files)
    assert any(name.startswith("tensorboard/events.out.tfevents.") for name in files)
    assert any(name.startswith("samples/step_") for name in files)
    assert "run.lock" not in files  # released at the end
    assert metric_steps(run) == list(range(1, last + 1))

    resumed = loop.train(small_train_config(run, steps=3, resume=True))
    assert resumed["steps"] == last + 1 and metric_steps(run) == list(range(1, last + 2))  # every step once

    before = listing(run)
    with pytest.raises(FileExistsError, match=rf"{run} already has checkpoints \(latest step {last + 1}\)"):
        loop.train(small_train_config(run, steps=3))
    assert listing(run) == before  # the refused launch changed nothing
    assert os.listdir(tmp_path) == []  # and no run file went to the working directory
