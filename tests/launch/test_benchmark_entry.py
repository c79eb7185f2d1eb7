"""`launch/benchmark.py` runs a suite end to end (tiny sizes) and rejects unknown suites; the suites that
compile a model (forward, critic, sampler) are slow tests."""

from __future__ import annotations

import pytest
from conftest import launch_script


def benchmark(*args):
    return launch_script("launch/benchmark.py", *args)


@pytest.mark.slow
def test_forward_suite_prints_ratio_table():
    result = benchmark("forward", "--batch=2", "--length=16", "--repeats=1")
    assert result.returncode == 0, result.stderr
    assert "speed vs torch" in result.stdout
    assert sum("x" in line.split()[-1] for line in result.stdout.splitlines()[2:]) == 3


def test_credit_suite_checks_agreement_and_prints_ratios():
    result = benchmark("credit", "--batch=2", "--length=64", "--repeats=1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    names = [line.rsplit(None, 2)[0].strip() for line in lines[2:]]
    assert names[:2] == ["comp_gae scan (jit)", "comp_gae associative (jit)"]
    assert any(name.startswith("rlax") for name in names) and names[-1] == "NumPy loop"
    assert all(line.endswith("x") for line in lines[2:])


def test_unknown_suite_is_refused():
    result = benchmark("nonsense")
    assert result.returncode != 0 and "SUITE one of" in result.stderr


def test_kernel_suite_prints_time_and_memory_side_by_side():
    result = benchmark("kernel", "--length=128", "--repeats=1")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    # Plain attention, the kernel, and the kernel with every optional statistic ("+ entropy, ...").
    assert [row[1] for row in rows] == [
        "dot_product_attention",
        "attention_with_concentration",
        "attention_with_concentration",
    ]
    assert "+" in rows[2] and "+" not in rows[1]
    assert rows[0][-2] == "1.00x" and rows[1][-2] == "1.00x" and rows[2][-2].endswith("x")  # vs plain; vs H only
    assert all(float(row[-1]) > 0 for row in rows)  # memory MiB


@pytest.mark.slow
def test_critic_suite_prints_stages_against_the_policy_forward():
    result = benchmark("critic", "--length=64", "--repeats=1")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert len(rows) == 6 and all(row[-1].endswith("x") for row in rows)
    assert {row[0] for row in rows} == {"tiny", "qwen3-0.6b-like"}


@pytest.mark.slow
def test_sampler_suite_prints_each_workload_against_the_other_samplers():
    result = benchmark("sampler", "--batch=2", "--length=8", "--repeats=1")
    assert result.returncode == 0, result.stderr
    sections = {block.splitlines()[0].split(":")[0]: block.splitlines()[1:] for block in result.stdout.split("\n\n")}
    assert "token agreement 1.000" in result.stdout  # fp32 greedy: transformers emits the same tokens
    tiny = sections[next(name for name in sections if name.startswith("jax"))]
    assert tiny[0].startswith("tiny") and len(tiny) == 4 and all(row.endswith("x") for row in tiny[2:])
    plain = sections["plain decode"][1:]
    assert [row.split()[1] for row in plain] == ["comppo_jax", "dense", "transformers"]  # tunix needs --tunix_python
    assert all(row.split()[-2] == "1.000" for row in plain)  # the counter model: every sampler emits the same tokens
    floor = next(line for line in result.stdout.splitlines() if line.startswith("matmul floor per step: "))
    assert "XLA " in floor and "torch " in floor and floor.count("GFLOP/s") == 2
    assert [row.split()[0] for row in sections["uniform"][1:]] == ["comppo_jax", "dense"]
    assert [row.split()[0] for row in sections["long-tailed"][1:]] == ["comppo_jax", "dense"]


def test_host_suite_times_decoding_and_verification():
    result = benchmark("host", "--batch=4", "--length=64", "--repeats=1")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    rows = [
        line.split() for line in lines[lines.index(next(line for line in lines if line.split()[0] == "work")) + 1 :]
    ]
    assert [row[0] for row in rows] == ["decode", "verify"] and all(float(row[-1]) >= 0 for row in rows)
