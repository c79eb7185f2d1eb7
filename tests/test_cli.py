"""How the launch/ entry points start: --help, and a quiet CPU without an accelerator."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from conftest import CPU_ONLY_ENV, REPO, require_libtpu

from comppo_jax.cli import _config_rows, with_run_config
from comppo_jax.eval.experiment import FIELD_HELP as EXPERIMENT_HELP
from comppo_jax.models import load_config_file
from comppo_jax.models.loading import PRESET_DIR
from comppo_jax.train.paper import FIELD_HELP


def launch(*args, env=CPU_ONLY_ENV, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("preset", ["tiny.py", "qwen3_4b.py", "llama3_8b.py"])
def test_every_field_of_each_preset_has_a_description(preset):
    rows = _config_rows(load_config_file(os.path.join(REPO, "configs", preset)), FIELD_HELP)
    undescribed = [name for fields in rows.values() for name, _, description in fields if not description]
    assert not undescribed and len(rows) == 13  # 12 sections and the top level


def test_help_exits_0_and_lists_the_loaded_configs_fields():
    result = launch("launch/train.py", "--config=configs/qwen3_4b.py", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Train with CompPO, GRPO or PPO")
    assert "--config fields (from configs/qwen3_4b.py, with the overrides given)" in result.stdout and "\n[rollout]\n" in result.stdout
    line = next(line for line in result.stdout.splitlines() if "--config.rollout.max_new_tokens=" in line)
    assert re.fullmatch(r"\s+--config\.rollout\.max_new_tokens=16384\s+longest response", line), line

    # A field whose "auto" stands for another value says which, with the command line's overrides applied.
    line = next(line for line in result.stdout.splitlines() if "--config.train.loss_aggregation=" in line)
    assert "'auto'" in line and "[here: token-mean]" in line, line
    gspo = launch("launch/train.py", "--config.method=grpo", "--config.train.policy_loss=gspo", "--help")
    assert gspo.returncode == 0, gspo.stderr
    assert "--config.train.policy_loss='gspo'" in gspo.stdout and "[here: seq-mean-token-mean]" in gspo.stdout

    experiment = launch("launch/experiment.py", "--experiment=configs/experiments.py:main", "--help")
    assert experiment.returncode == 0, experiment.stderr
    for name, description in EXPERIMENT_HELP.items():
        assert f"--experiment.{name}=" in experiment.stdout and description in experiment.stdout


def test_a_cpu_run_without_jax_platforms_logs_no_error_lines():
    """With libtpu installed (the `tpu` extra) and no TPU, JAX alone would start the TPU plugin,
    which logs E-level lines; the launchers select the CPU first."""
    require_libtpu()
    if importlib.util.find_spec("jax_cuda12_plugin") or os.path.exists("/dev/nvidia0"):
        pytest.skip("a GPU is attached or its plugin installed")
    env = {k: v for k, v in CPU_ONLY_ENV.items() if k != "JAX_PLATFORMS"}
    result = launch("launch/score.py", "--batch_size=2", env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not [line for line in result.stderr.splitlines() if re.match(r"[EF]\d{4} ", line) or "Unable to initialize backend" in line], \
        result.stderr[-2000:]


def test_a_run_named_without_a_config_brings_its_own_config_first():
    own = f"--config={PRESET_DIR / 'run.py'}:runs/a"
    assert with_run_config(["eval.py", "--checkpoint=runs/a", "--config.eval.samples=2"], "checkpoint") == [
        "eval.py", own, "--checkpoint=runs/a", "--config.eval.samples=2"]
    assert with_run_config(["eval.py", "--config.eval.samples=2", "--checkpoint", "runs/a"], "checkpoint")[1] == own
    for given in (["eval.py", "--config=configs/tiny.py", "--checkpoint=runs/a"], ["eval.py", "--config", "x.py", "--checkpoint=runs/a"],
                  ["eval.py", "--step=best"]):
        assert with_run_config(given, "checkpoint") == given
