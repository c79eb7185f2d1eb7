"""`launch/gpu_validation.sh` fits one device call: steps in order under their caps and a budget, a step
past its limit reported and rerunnable, not fatal. Run here with SMOKE=1 (small sizes, the CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import CPU_ONLY_ENV, HANG_S, REPO


def validation(tmp_path, *steps: str, during=None, **env: str):
    """The script's result and summary lines; `during(pid)`, if given, runs while it does."""
    script = subprocess.Popen(
        ["bash", "launch/gpu_validation.sh", *steps],
        cwd=REPO,
        env=dict(CPU_ONLY_ENV, SMOKE="1", PYTHON=sys.executable, OUT=str(tmp_path), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if during is not None:
        during(script.pid)
    stdout, stderr = script.communicate(timeout=HANG_S)
    result = subprocess.CompletedProcess(script.args, script.returncode, stdout, stderr)
    summary = (tmp_path / "summary.txt").read_text().splitlines() if (tmp_path / "summary.txt").exists() else []
    return result, summary


def test_a_step_past_its_cap_is_stopped_and_the_next_one_runs(tmp_path):
    result, summary = validation(tmp_path, "kernel", "env", CAP_kernel="1")
    assert result.returncode == 1, result.stderr
    assert summary[0].startswith("kernel: timed out after ") and summary[0].endswith("(limit 1 s)")
    assert summary[1].startswith("env: exit 0 in ")
    assert summary[2] == "not finished: kernel; rerun them: bash launch/gpu_validation.sh kernel"
    assert "jax " in (tmp_path / "validation.log").read_text()  # the env step's versions


def descendant(pid: int, command: str) -> int | None:
    """The pid of a process under `pid` whose command line contains `command` (not another test's)."""
    table = [
        line.split(None, 2)
        for line in subprocess.check_output(["ps", "-eo", "pid=,ppid=,args="], text=True).splitlines()
    ]
    children: dict[int, list[tuple[int, str]]] = {}
    for child, parent, *args in table:
        children.setdefault(int(parent), []).append((int(child), args[0] if args else ""))
    stack = [pid]
    while stack:
        for child, args in children.get(stack.pop(), []):
            if command in args:
                return child
            stack.append(child)
    return None


def test_a_step_killed_before_its_limit_is_a_failure_not_a_timeout(tmp_path):
    """A benchmark killed on its own (as by the out-of-memory killer) exits 137 like one `timeout`
    kills: the summary tells them apart by the time it ran."""

    def kill_the_kernel_benchmark(script_pid: int):
        for _ in range(600):
            benchmark = descendant(script_pid, "benchmark.py kernel")
            if benchmark is not None:
                os.kill(benchmark, signal.SIGKILL)
                return
            time.sleep(0.05)
        raise AssertionError("the kernel benchmark never started")

    result, summary = validation(tmp_path, "kernel", during=kill_the_kernel_benchmark)
    assert result.returncode == 1, result.stderr
    assert summary[0].startswith("kernel: exit 137 in "), summary
    assert len(summary) == 1  # nothing unfinished to rerun


def test_the_budget_limits_a_step_and_skips_those_it_cannot_start(tmp_path):
    result, summary = validation(tmp_path, "kernel", "env", "credit", BUDGET_S="3", MIN_STEP_S="2")
    assert result.returncode == 1, result.stderr
    assert summary[0].startswith("kernel: timed out after ") and summary[0].endswith("(limit 3 s)")
    assert summary[1].startswith("env: skipped, ") and summary[2].startswith("credit: skipped, ")
    assert summary[3].endswith("rerun them: bash launch/gpu_validation.sh kernel env credit")


def test_a_finished_run_exits_0_and_an_unknown_step_is_refused_before_any_runs(tmp_path):
    result, summary = validation(tmp_path, "env")
    assert result.returncode == 0 and len(summary) == 1 and summary[0].startswith("env: exit 0 in "), summary
    refused, _ = validation(tmp_path / "refused", "env", "kernels")
    assert refused.returncode == 2 and "unknown step kernels" in refused.stderr
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_every_benchmark_step_runs_at_small_sizes(tmp_path):
    """The steps no other test runs, at their SMOKE sizes: the gpu-marked tests (skipped off a GPU), the
    step, LoRA and staleness suites, the kernel profile. Not `tests` (the same test files the fast and slow
    tiers run) nor the kernel, sampler and credit suites, which tests/launch/test_benchmark_entry.py runs
    (and the kernel step starts in the fast tests above)."""
    steps = ("env", "gpu_tests", "step", "lora", "staleness", "profile")
    result, summary = validation(tmp_path, *steps)
    assert result.returncode == 0, "\n".join(summary) + result.stdout[-3000:]
    assert [line.split(":")[0] for line in summary] == list(steps)
    log = (tmp_path / "validation.log").read_text()
    assert "MFU measured" in log and "staleness 1 / 0: " in log and "LoRA r8" in log
    assert (tmp_path / "kernel_trace.tar.gz").stat().st_size > 0 and (tmp_path / "gpu_tests.xml").exists()
