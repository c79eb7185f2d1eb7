"""Frozen evaluation: the majority vote's tie rule, and launch/eval.py on a checkpoint from a 2-step run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
from conftest import CPU_ONLY_ENV, small_train_config

from comppo_jax.eval import majority_answer
from comppo_jax.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_majority_vote_ties_go_to_the_earliest_sample_and_missing_answers_do_not_vote():
    assert majority_answer(["3", "4", "4", "3"]) == "3"  # 2-2 tie: "3" came first
    assert majority_answer(["4", "3", "3", "4"]) == "4"
    assert majority_answer([None, None, "7", " 8", "8 "]) == "8"  # stripped strings vote
    assert majority_answer([None, "5", None]) == "5"
    assert majority_answer([None, None]) is None


@pytest.mark.slow
def test_eval_restores_a_training_checkpoint_and_writes_a_resumable_table(tmp_path):
    run = tmp_path / "run"
    train(small_train_config(run))
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"{i} +2 =?\n", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}) + "\n"
                             for i in range(3)))
    # No --config: the run's own (its dev set of 4, 12 new tokens, one verifier), two fields on top.
    command = [sys.executable, "launch/eval.py", f"--checkpoint={run}", "--step=best", f"--config.eval.benchmarks=gsm8k={gsm8k}",
               "--config.eval.samples=2"]
    result = subprocess.run(command, cwd=ROOT, env=CPU_ONLY_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    (output,) = (run / "eval").iterdir()  # step_<best>
    with open(output / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["set"] for r in rows] == ["id_dev", "gsm8k", "macro (frozen)"]
    assert rows[0]["problems"] == "4" and rows[1]["problems"] == "3"
    assert all(0.0 <= float(r[m]) <= 1.0 for r in rows for m in ("greedy_pass@1", "majority@2"))
    assert "| gsm8k | 3 |" in result.stdout

    # A finished set is read back, not recomputed.
    (output / "gsm8k.json").write_text(json.dumps({"problems": 3, "greedy_pass@1": 0.5, "majority@2": 0.25}))
    again = subprocess.run(command, cwd=ROOT, env=CPU_ONLY_ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "| gsm8k | 3 | 0.500 | 0.250 |" in again.stdout

    missing = subprocess.run(command[:3] + ["--step=7"] + command[4:], cwd=ROOT, env=CPU_ONLY_ENV, capture_output=True, text=True,
                             timeout=600)
    assert missing.returncode != 0 and "no checkpoint '7'" in missing.stderr
