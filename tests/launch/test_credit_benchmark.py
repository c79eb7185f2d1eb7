"""The credit benchmark suite runs end to end at a tiny size (needs rlax, the `bench` extra)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_credit_suite_checks_agreement_and_prints_ratios(capsys):
    pytest.importorskip("rlax")
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    try:
        from benchmarks import credit
    finally:
        sys.path.pop(0)
    rows = credit.run(batch=2, length=64, repeats=1)
    names = [row["implementation"] for row in rows]
    assert names[:2] == ["comp_gae scan (jit)", "comp_gae associative (jit)"]
    assert any(name.startswith("rlax") for name in names) and names[-1] == "NumPy loop"
    assert all(row["ms"] > 0 for row in rows)
    assert "time / rlax" in capsys.readouterr().out
