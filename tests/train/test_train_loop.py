"""launch/train.py end to end on the tiny default, shrunk to a couple of steps, for each method."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import CPU_ONLY_ENV, SMALL_TRAIN_RUN

from comppo_jax.credit import load_position_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [f"--config.{key}={value}" for key, value in SMALL_TRAIN_RUN.items()]


@pytest.mark.slow
@pytest.mark.parametrize("method,warmup_counts", [("comppo", False), ("grpo", False), ("ppo", False), ("ppo", True)])
def test_train_runs_each_method(tmp_path, method, warmup_counts):
    result = subprocess.run(
        [sys.executable, "launch/train.py", "--config=configs/tiny.py", f"--config.method={method}",
         f"--config.output_dir={tmp_path}", *SMALL, "--config.plot=True", f"--config.train.critic_warmup_counts_toward_steps={warmup_counts}"],
        cwd=ROOT, env=CPU_ONLY_ENV, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["method"] == method and 0.0 <= summary["final_dev_accuracy"] <= 1.0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The critic warm-up (1 step) comes on top of the 2 actor updates unless it counts toward them.
    warmup = 0 if method == "grpo" else 1
    total = 2 if warmup_counts else 2 + warmup
    assert [s["step"] for s in steps] == list(range(total))
    assert summary["steps"] == total and summary["actor_updates"] == total - warmup == sum("policy_loss" in s for s in steps)
    # Evaluations (every step here) count actor updates: a prepended warm-up step is not evaluated.
    prepended = total - 2
    assert [s["step"] for s in steps if "dev_accuracy" in s] == list(range(prepended, total))
    assert [s["actor_updates"] for s in steps] == [max(0, i + 1 - warmup) for i in range(total)]
    assert ("value_loss" in steps[1]) == (method != "grpo")
    assert "policy_loss" in steps[1] and ("policy_loss" in steps[0]) == (method == "grpo")  # critic warm-up
    assert {"gate/mean", "gate/iqr", "gate/first_third", "gate/last_third", "entropy", "clip_fraction", "kl_loss"} <= set(steps[1])
    if method != "grpo":
        assert {"critic/value_mae", "critic/clamp_saturation"} <= set(steps[1])
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))
    assert str(total) in os.listdir(tmp_path / "checkpoints")
    profile = load_position_schedule(tmp_path / "gate_profile.json")  # every rollout token's own gate, by t/T
    assert profile.token_counts.sum() == sum(s["response_length"] * 4 for s in steps)  # 2 prompts x 2 samples per step
    assert summary["mean_gate"] == pytest.approx(np.sum(profile.mean_gate * profile.token_counts) / profile.token_counts.sum())
