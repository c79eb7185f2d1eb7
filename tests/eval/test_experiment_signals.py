"""Stopping launch/experiment.py: a SIGINT to the runner stops its run at a checkpoint, which the report
names as unfinished and the same command finishes; kill -9 of the runner takes its run down with it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import CPU_ONLY_ENV, HANG_S, REPO, SMALL_TRAIN_RUN, launch_script

# One tiny run of 4 steps (5 with the critic warm-up): signalled after its first step, it has steps left.
ARMS = (("comppo", ("method=comppo", "train.critic_warmup_counts_toward_steps=False")),)
OVERRIDES = tuple(f"{k}={v}" for k, v in {**SMALL_TRAIN_RUN, "steps": 4}.items() if k not in ("progress", "plot"))


def experiment_command(root, held_out_problems: int = 0) -> list[str]:
    return [
        "launch/experiment.py",
        "--experiment=configs/experiments_tiny.py:group",
        f"--root={root}",
        "--experiment.seeds=(0,)",
        f"--experiment.arms={ARMS!r}",
        f"--experiment.overrides={OVERRIDES!r}",
        f"--experiment.held_out_problems={held_out_problems}",
    ]


@contextlib.contextmanager
def runner_past_its_first_step(root, command: list[str]):
    """(the runner, its run's directory) once the run has logged a step; the runner's output goes to
    <root>/runner.log. The runner and whatever it started are killed at the end, whatever happened."""
    root.mkdir(exist_ok=True)
    with open(root / "runner.log", "w") as out:
        runner = subprocess.Popen(
            [sys.executable, *command], cwd=REPO, env=CPU_ONLY_ENV, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.time() + HANG_S
        while True:
            assert runner.poll() is None, (root / "runner.log").read_text()[-3000:]
            assert time.time() < deadline, "the run logged no step"
            metrics = list((root / "runs").glob("*/metrics.jsonl"))
            rows = metrics[0].read_text().split("\n")[:-1] if metrics else []  # whole lines only
            if any(json.loads(row).get("step", 0) >= 1 for row in rows):
                break
            time.sleep(0.5)
        yield runner, metrics[0].parent
    finally:
        runner.kill()
        runner.wait()
        for lock in (root / "runs").glob("*/run.lock"):  # a train.py that outlived the runner
            with contextlib.suppress(OSError, ValueError):
                os.kill(json.loads(lock.read_text())["pid"], signal.SIGKILL)


def train_commands(run) -> list[str]:
    """The launch/train.py command lines the runner logged to the run's train.log."""
    lines = (run / "train.log").read_text().splitlines()
    return [line for line in lines if line.startswith("$ ") and "launch/train.py" in line]


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_sigint_to_the_runner_leaves_its_run_unfinished_and_named_and_the_same_command_finishes_it(tmp_path):
    command = experiment_command(tmp_path, held_out_problems=2)
    with runner_past_its_first_step(tmp_path, command) as (runner, run):
        runner.send_signal(signal.SIGINT)  # the runner alone: it forwards the signal to its run
        assert runner.wait(timeout=HANG_S) == 130
    output = (tmp_path / "runner.log").read_text()
    assert re.search(r"UNFINISHED comppo seed 0: newest checkpoint at step \d", output), output[-3000:]
    assert "stopped: checkpoint" in (run / "train.log").read_text()
    # Not a result: no summary, and no held-out diagnostics of the partial run.
    assert not (run / "summary.json").exists() and not (run / "held_out.json").exists()
    report = (tmp_path / "group" / "report.md").read_text()
    assert "No run finished." in report
    assert re.search(
        r"## Unfinished runs\n\nThe experiment was stopped by SIGINT\. .*`python launch/experiment\.py .*` resumes "
        r"each from its newest checkpoint.*\n\n- comppo seed 0: newest checkpoint at step \d",
        report,
    ), report

    again = launch_script(*command)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    first, resumed = train_commands(run)
    assert not first.endswith("--config.resume=True") and resumed.endswith("--config.resume=True")
    assert (run / "summary.json").exists() and (run / "held_out.json").exists()
    report = (tmp_path / "group" / "report.md").read_text()
    assert "| comppo | 0 |" in report and "Unfinished" not in report


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_kill_9_of_the_runner_stops_its_run_at_a_checkpoint_and_frees_the_run_for_the_same_command(tmp_path):
    """The run's parent-death signal stops it as SIGTERM does: a checkpoint, then its lock released, so the
    same command resumes it as after a SIGINT (the test above) instead of finding the run locked."""
    command = experiment_command(tmp_path)
    with runner_past_its_first_step(tmp_path, command) as (runner, run):
        child = json.loads((run / "run.lock").read_text())["pid"]  # train.py holds its run's lock
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        deadline = time.time() + 60  # the step in progress and the save (3 s on a 2-core CPU)
        while running(child) and time.time() < deadline:
            time.sleep(0.2)
        assert not running(child), "train.py outlived the runner"
    log = (run / "train.log").read_text()
    assert "SIGTERM received" in log and "stopped: checkpoint" in log, log[-3000:]
    assert not (run / "run.lock").exists()  # released: the next launch takes the run, not RunDirectoryLocked


@pytest.mark.slow
def test_a_run_stopped_by_a_signal_of_its_own_is_unfinished_not_a_result_to_evaluate(tmp_path):
    """SIGTERM to launch/train.py alone (a scheduler, an admin): it saves a checkpoint and exits 0; the
    runner still reads the run as unfinished, runs no held-out diagnostics of its checkpoint and fails."""
    command = experiment_command(tmp_path, held_out_problems=2)
    with runner_past_its_first_step(tmp_path, command) as (runner, run):
        os.kill(json.loads((run / "run.lock").read_text())["pid"], signal.SIGTERM)
        assert runner.wait(timeout=HANG_S) == 1
    output = (tmp_path / "runner.log").read_text()
    assert re.search(r"UNFINISHED comppo seed 0: newest checkpoint at step \d", output), output[-3000:]
    assert "launch/eval.py" not in (run / "train.log").read_text() and not (run / "held_out.json").exists()
    report = (tmp_path / "group" / "report.md").read_text()
    assert "## Unfinished runs\n\nThese runs are not in the tables above" in report and "- comppo seed 0: " in report
