"""`launch/benchmark.py` runs a suite end to end (tiny sizes) and rejects unknown suites."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def benchmark(*args):
    return subprocess.run([sys.executable, "launch/benchmark.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_forward_suite_prints_ratio_table():
    result = benchmark("forward", "--batch=2", "--length=16", "--repeats=1")
    assert result.returncode == 0, result.stderr
    assert "speed vs torch" in result.stdout
    assert sum("x" in line.split()[-1] for line in result.stdout.splitlines()[2:]) == 3


def test_unknown_suite_is_refused():
    result = benchmark("nonsense")
    assert result.returncode != 0 and "SUITE one of" in result.stderr
