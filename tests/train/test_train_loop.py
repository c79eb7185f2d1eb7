"""launch/train.py end to end on the tiny default, shrunk to a couple of steps, for each method."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [
    "--config.steps=2", "--config.warm_start.steps=3", "--config.data.train_size=40", "--config.data.dev_size=4",
    "--config.rollout.prompts_per_step=2", "--config.rollout.samples_per_prompt=2", "--config.rollout.max_new_tokens=12",
    "--config.train.minibatch_size=2", "--config.train.critic_warmup_steps=1", "--config.train.eval_every=1",
    "--config.progress=False", "--config.reward.workers=1",
]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["comppo", "grpo", "ppo"])
def test_train_runs_each_method(tmp_path, method):
    result = subprocess.run(
        [sys.executable, "launch/train.py", "--config=configs/tiny.py", f"--config.method={method}",
         f"--config.output_dir={tmp_path}", *SMALL],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["method"] == method and 0.0 <= summary["final_dev_accuracy"] <= 1.0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1] and all("dev_accuracy" in s for s in steps)
    assert ("value_loss" in steps[1]) == (method != "grpo")
    assert "policy_loss" in steps[1] and ("policy_loss" in steps[0]) == (method == "grpo")  # critic warm-up
