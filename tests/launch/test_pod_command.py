"""The pod command as docs/training.md gives it ("Running on a TPU pod"), on 127.0.0.1: the model and
the data named by hub id (huggingface_hub's real client against tests/hub_server.py), the run
directory a gs:// bucket (tests/gcs_emulator.py), 2 processes started the way every worker of a pod
starts (launch/local_cluster.py), killed with SIGKILL mid-run, resumed; then the run is evaluated
offline (the pinned commits from the cache), exported and reported, all from the bucket."""

from __future__ import annotations

import json
import signal

import jax
import pytest
from conftest import CPU_ONLY_ENV, cluster_tail, launch_script, on_local_cluster, save_word_tokenizer, small_train_flags
from hub_server import hub_env, start_hub, write_dapo

from comppo_jax import storage
from comppo_jax.models import load_config_file, model_config, to_hf
from comppo_jax.models.transformer import init_params

MODEL, DATASET = "tiny-org/comppo-tiny", "math-org/dapo-tiny"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub serving a random model of configs/tiny.py's architecture (with a word tokenizer whose <eos>
    is the architecture's) and a small DAPO-Math parquet."""
    model_dir, data_dir = tmp_path_factory.mktemp("hub_model"), tmp_path_factory.mktemp("hub_data")
    config = model_config(load_config_file("configs/tiny.py").model)
    to_hf(config, init_params(config, jax.random.key(0)), str(model_dir))
    save_word_tokenizer(model_dir, ["what", "is", "+", "1", "?", "Answer", ":"])
    write_dapo(data_dir, problems=12)
    server = start_hub()
    server.commits = {MODEL: server.add("model", MODEL, model_dir), DATASET: server.add("dataset", DATASET, data_dir)}
    yield server
    server.stop()


@pytest.mark.slow
def test_the_pod_command_on_a_bucket_with_hub_ids_survives_kill_9_and_evaluates_exports_and_reports(
    hub, gcs_emulator, bucket, tmp_path
):
    run = f"{bucket}/runs/pod"
    env = {**gcs_emulator.env, **hub_env(hub.url, tmp_path / "hf")}
    flags = small_train_flags(
        run,
        steps=4,
        model__path=MODEL,
        data__kind="dapo_math",
        data__path=DATASET,
        warm_start__steps=0,
        train__minibatch_size=4,
    )
    metrics = storage.path(f"{run}/metrics.jsonl")
    killed = on_local_cluster(
        flags, devices_per_process=2, signal_after_rows=2, signum=signal.SIGKILL, metrics=metrics, env=env
    )
    assert killed.returncode != 0 and metrics.exists(), cluster_tail(killed)  # killed mid-run, not failed
    recorded = json.loads(storage.read_text(f"{run}/config.json"))
    assert recorded["model"]["path"] == f"{MODEL}@{hub.commits[MODEL]}"
    assert recorded["data"]["path"] == f"{DATASET}@{hub.commits[DATASET]}"

    resumed = on_local_cluster([*flags, "--config.resume=True"], devices_per_process=2, env=env)
    assert resumed.returncode == 0, cluster_tail(resumed)
    assert resumed.earlier == []  # no gloo rerun was needed
    last = json.loads(storage.read_text(f"{run}/summary.json"))["steps"]
    steps = [json.loads(line)["step"] for line in storage.read_lines(metrics)]
    assert steps == list(range(1, last + 1))  # every step once, the killed attempt's extra rows set aside

    offline = {**CPU_ONLY_ENV, **env, "HF_HUB_OFFLINE": "1"}  # the pinned commits load from the cache
    # on one machine, as a user checks a pod's run (on the pod itself: every worker, --config.mesh.distributed=True)
    evaluated = launch_script("launch/eval.py", f"--checkpoint={run}", "--step=latest", env=offline)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads(storage.read_text(f"{run}/eval/step_{last}/results.json"))
    assert results["checkpoint"] == run and results["rows"]
    exported = launch_script("launch/export.py", f"--run={run}", "--step=latest", f"--out={bucket}/export", env=offline)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(storage.names(f"{bucket}/export"))
    reported = launch_script("launch/report.py", f"--run={run}", env=offline)
    assert reported.returncode == 0, reported.stderr[-3000:]
    page = storage.read_text(f"{run}/report.html")
    assert run in page and "Where the credit went" in page
