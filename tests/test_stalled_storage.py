"""Bucket and hub endpoints that accept a connection and never answer (tests/stalling_server.py): every call
fails within COMPPO_STORAGE_TIMEOUT_S (3 s here) and a margin, naming the endpoint and what it was doing.

Each case runs in a subprocess bounded by `subprocess.run(timeout=...)`: the clients read their timeout
settings when they start, and without those settings the call waits forever, so the subprocess outruns its
bound and the test fails instead of hanging."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import CPU_ONLY_ENV, REPO
from stalling_server import StallingProxy

TIMEOUT_S = 3
IMPORTS_S = 30  # a subprocess importing JAX and Orbax on 2 busy cores


@pytest.fixture
def stalled():
    proxy = StallingProxy()
    yield proxy
    proxy.stop()


def run_python(code: str, env: dict, bound_s: float) -> tuple[subprocess.CompletedProcess, float]:
    """`python -c code` from the repository root with `env` and COMPPO_STORAGE_TIMEOUT_S=3; (result, seconds)."""
    return run_command([sys.executable, "-c", code], env, bound_s)


def run_command(command: list[str], env: dict, bound_s: float) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(
        command,
        cwd=REPO,
        env={**CPU_ONLY_ENV, **env, "COMPPO_STORAGE_TIMEOUT_S": str(TIMEOUT_S)},
        capture_output=True,
        text=True,
        timeout=bound_s,
    )
    return result, time.monotonic() - start


def stalled_bucket_env(emulator, proxy, tensorstore_too: bool = True) -> dict:
    """The emulator's variables with gcsfs (and tensorstore) sent through `proxy`."""
    env = {**emulator.env, "STORAGE_EMULATOR_HOST": proxy.url}
    return {**env, "TENSORSTORE_GCS_HTTP_URL": proxy.url} if tensorstore_too else env


def test_a_metrics_flush_to_a_bucket_that_stops_answering_mid_run_fails_naming_endpoint_and_object(
    gcs_emulator, bucket
):
    """The bucket answers (the first flush creates the file), then goes silent: the next flush raises
    StorageTimeout within the timeout. Guard: gcsfs's requests_timeout (comppo_jax.storage._bound_requests)."""
    proxy = StallingProxy(target=gcs_emulator.url)
    code = f"""
import sys, time
sys.path.insert(0, "tests")
from comppo_jax import storage
log = storage.AppendLog("{bucket}/run/metrics.jsonl")
log.append("{{}}"); log.flush()
print("stall", flush=True); sys.stdin.readline()
start = time.monotonic()
log.append("{{}}")
try:
    log.flush()
except storage.StorageTimeout as error:
    print(f"after {{time.monotonic() - start:.1f}} s: {{error}}")
"""
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**CPU_ONLY_ENV, **stalled_bucket_env(gcs_emulator, proxy), "COMPPO_STORAGE_TIMEOUT_S": str(TIMEOUT_S)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "stall\n", process.stderr.read()
        proxy.stall()
        out, err = process.communicate("go\n", timeout=4 * TIMEOUT_S + 10)
    finally:
        process.kill()
        proxy.stop()
    assert process.returncode == 0, err[-2000:]
    seconds, message = out.split(": ", 1)
    assert float(seconds.split()[1]) < 2 * TIMEOUT_S + 2, out
    assert f"{proxy.url} (STORAGE_EMULATOR_HOST) did not answer" in message
    assert f"{bucket}/run/metrics.jsonl" in message and "COMPPO_STORAGE_TIMEOUT_S" in message


def test_a_hub_that_never_answers_is_one_config_error_naming_the_endpoint(stalled, tmp_path):
    """Guard: the request timeout comppo_jax.hub gives huggingface_hub's client (repo_info sets none)."""
    code = """
from comppo_jax import hub
from comppo_jax.errors import ConfigError
try:
    hub.resolve_model("owner/name")
except ConfigError as error:
    print(error)
"""
    env = {"HF_ENDPOINT": stalled.url, "HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    result, seconds = run_python(code, env, bound_s=IMPORTS_S + 4 * TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{stalled.url} cannot be reached (timed out)" in result.stdout, result.stdout


@pytest.mark.slow
def test_a_checkpoint_commit_to_a_bucket_that_never_answers_fails_within_its_attempts(gcs_emulator, bucket, stalled):
    """Orbax's writes (tensorstore) go to the stalled endpoint, the rest to the emulator: the save's
    confirmation raises CheckpointError naming the step and the cause. Guards: tensorstore's low-speed limit
    (comppo_jax.storage) and its bounded attempts (comppo_jax.runs.checkpoint.GCS_ATTEMPTS); without either the
    save waits 32 attempts or forever."""
    code = f"""
import numpy as np
from comppo_jax.runs.checkpoint import RunCheckpoints
from comppo_jax.models import CheckpointError
checkpoints = RunCheckpoints("{bucket}/run")
checkpoints.save(1, {{"w": np.arange(8.0, dtype=np.float32)}}, {{}})
try:
    checkpoints.confirm_saves(wait=True)
except CheckpointError as error:
    print(error)
"""
    env = {**gcs_emulator.env, "TENSORSTORE_GCS_HTTP_URL": stalled.url}
    result, seconds = run_python(code, env, bound_s=IMPORTS_S + 10 * TIMEOUT_S + 30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"saving checkpoint 1 to {bucket}/run/checkpoints/1 failed" in result.stdout, result.stdout
    assert "Less than 1 bytes/sec transferred the last 3 seconds" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher", [["launch/train.py", "--config=configs/tiny.py"], ["launch/report.py"]], ids=["train", "report"]
)
def test_a_launcher_on_a_bucket_that_never_answers_ends_with_one_error_line(gcs_emulator, stalled, launcher):
    """Guard: gcsfs's requests_timeout. Without it the launcher waits silently past its bound."""
    run = "gs://bucket/run"
    flag = "--config.output_dir=" if launcher[0] == "launch/train.py" else "--run="
    result, seconds = run_command(
        [sys.executable, *launcher, flag + run], stalled_bucket_env(gcs_emulator, stalled), IMPORTS_S + 4 * TIMEOUT_S
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith(
        f"error: StorageTimeout: {stalled.url} (STORAGE_EMULATOR_HOST) did not answer GET gs://bucket"
    )
    assert f"within {TIMEOUT_S} s (COMPPO_STORAGE_TIMEOUT_S sets the limit)" in errors[0]


@pytest.mark.slow
def test_sigterm_while_a_bucket_call_is_stalled_ends_the_launcher_within_the_timeout(gcs_emulator, stalled):
    """SIGTERM arriving while train.py's bucket check (before its stop handler is installed) is stalled: the
    process ends at once, by the signal's default action, not after the call."""
    import signal

    process = subprocess.Popen(
        [sys.executable, "launch/train.py", "--config=configs/tiny.py", "--config.output_dir=gs://bucket/run"],
        cwd=REPO,
        env={**CPU_ONLY_ENV, **stalled_bucket_env(gcs_emulator, stalled), "COMPPO_STORAGE_TIMEOUT_S": "600"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + IMPORTS_S * 3
        while stalled.connections == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stalled.connections, "train.py never reached the bucket"
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=TIMEOUT_S + 5)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGTERM and time.monotonic() - sent < TIMEOUT_S + 5


@pytest.mark.slow
def test_sigterm_to_a_run_whose_bucket_went_silent_ends_it_within_the_bounded_calls(gcs_emulator, bucket, tmp_path):
    """A run past its first steps, its bucket then silent, then SIGTERM (a preemption during an outage): the
    stop finishes the step and tries its checkpoint; every call it makes fails within the bound, so the run
    ends in one error line long before the outage would (without the bound, it waits for good)."""
    import signal

    from conftest import small_train_flags

    from comppo_jax import storage

    proxy = StallingProxy(target=gcs_emulator.url)
    run = f"{bucket}/run"
    with open(tmp_path / "out", "w") as out:
        process = subprocess.Popen(
            [sys.executable, "launch/train.py", *small_train_flags(run, steps=1000, loggers="jsonl")],
            cwd=REPO,
            env={**CPU_ONLY_ENV, **stalled_bucket_env(gcs_emulator, proxy), "COMPPO_STORAGE_TIMEOUT_S": str(TIMEOUT_S)},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        deadline = time.monotonic() + 600
        while not storage.read_lines(f"{run}/metrics.jsonl"):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "out").read_text()[-3000:]
            time.sleep(0.5)
        proxy.stall()
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        process.kill()
        proxy.stop()
    output = (tmp_path / "out").read_text()
    assert process.returncode == 1 and time.monotonic() - sent < 120, output[-3000:]
    assert "Traceback" not in output
    (line,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert "StorageTimeout" in line or "CheckpointError" in line, line
