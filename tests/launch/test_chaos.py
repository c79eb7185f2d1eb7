"""A chaos run: a tiny run on a bucket meets a week's faults one after another (docs/reliability.md, "A chaos
run"): a reward worker SIGKILLed, the storage endpoint stalled for 30 s, the trainer SIGKILLed and resumed, its
whole process group sent SIGTERM and resumed. The finished run has every metrics row once, no step whose
verdicts the faults damaged, and the same checkpoints, bitwise, as the same run left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import CPU_ONLY_ENV, HANG_S, REPO, assert_same_checkpoint_state, small_train_flags
from stalling_server import StallingProxy

from comppo_jax import storage

STEPS = 10
STALL_S = 30.0


def flags(run) -> list[str]:
    return small_train_flags(
        run, steps=STEPS, train__eval_every=4, checkpoint__keep_last=STEPS + 2, reward__workers=2, loggers="jsonl"
    )


def start(run, env, out_dir, name, *extra) -> subprocess.Popen:
    """launch/train.py in a session of its own (so a signal to its group spares pytest), output to files."""
    with open(out_dir / f"{name}.out", "w") as out:
        return subprocess.Popen(
            [sys.executable, "launch/train.py", *flags(run), *extra],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def finished(process: subprocess.Popen, out_dir, name) -> str:
    process.wait(timeout=HANG_S)
    return (out_dir / f"{name}.out").read_text()


def rows(run) -> list[dict]:
    return [json.loads(line) for line in storage.read_lines(f"{run}/metrics.jsonl")]


def wait_for_step(run, step, process) -> None:
    deadline = time.time() + HANG_S
    while not rows(run) or rows(run)[-1]["step"] < step:
        assert process.poll() is None, f"the run ended before step {step}"
        assert time.time() < deadline, f"no step {step} within {HANG_S} s"
        time.sleep(0.5)


def verifier_workers(pid: int) -> list[int]:
    """The reward workers of process `pid` (its children running the verifier)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if parent == pid and b"verifier_worker" in command:
            found.append(int(entry))
    return found


@pytest.mark.slow
def test_a_run_that_meets_a_weeks_faults_finishes_whole_and_equal_to_one_left_alone(gcs_emulator, bucket, tmp_path):
    direct = {**CPU_ONLY_ENV, **gcs_emulator.env}
    straight_run, run = f"{bucket}/straight", f"{bucket}/chaos"
    straight = start(straight_run, direct, tmp_path, "straight")
    assert straight.wait(timeout=HANG_S) == 0, finished(straight, tmp_path, "straight")[-3000:]

    proxy = StallingProxy(target=gcs_emulator.url)
    env = {**direct, "STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}
    try:
        first = start(run, env, tmp_path, "first")
        wait_for_step(run, 2, first)
        (worker, *_) = verifier_workers(first.pid)
        os.kill(worker, signal.SIGKILL)  # the OOM killer: between reward calls, almost surely
        wait_for_step(run, 3, first)
        proxy.stall()  # every open and new connection to the bucket goes silent
        time.sleep(STALL_S)
        proxy.resume()
        wait_for_step(run, 5, first)
        os.kill(first.pid, signal.SIGKILL)
        finished(first, tmp_path, "first")

        second = start(run, env, tmp_path, "second", "--config.resume=True")
        wait_for_step(run, 7, second)
        os.killpg(second.pid, signal.SIGTERM)  # a scheduler's stop of the whole group, workers included
        output = finished(second, tmp_path, "second")
        assert second.returncode == 0 and "stopped: checkpoint" in output, output[-3000:]

        third = start(run, env, tmp_path, "third", "--config.resume=True")
        output = finished(third, tmp_path, "third")
        assert third.returncode == 0, output[-3000:]
    finally:
        proxy.stop()

    kept, last = rows(run), json.loads(storage.read_text(f"{run}/summary.json"))["steps"]  # the critic's warm-up too
    assert [row["step"] for row in kept] == list(range(1, last + 1)) == [row["step"] for row in rows(straight_run)]
    died = [row["step"] for row in kept if row.get("reward/died", 0)]
    assert len(died) <= 1  # the killed worker held an answer only if it was killed mid-call
    assert not [row["step"] for row in kept if row.get("reward/error", 0)]  # no stop damaged a verdict
    # Deterministic up to a verdict the kill cost: every checkpoint both runs hold, bitwise.
    last_equal = min(died, default=last + 1) - 1
    steps = [int(name) for name in storage.names(f"{run}/checkpoints") if name.isdigit()]
    compared = [step for step in steps if step <= last_equal]
    assert last in compared or died, steps
    for step in compared:
        assert_same_checkpoint_state(straight_run, run, step)
