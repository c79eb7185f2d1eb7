"""The paper presets fail fast without local weights or data, and run on a tiny Qwen3-format checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import CPU_ONLY_ENV, launch_quick, launch_script, save_word_tokenizer


def train(*flags):
    """launch/train.py on the preset, for launches that end in a config error."""
    return launch_quick("launch/train.py", "--config=configs/qwen3_4b.py", *flags)


def test_missing_weights_or_data_fail_fast_with_the_field_named(tmp_path):
    # The preset's hub ids offline with an empty cache: one line naming the id, before anything compiles.
    offline = dict(CPU_ONLY_ENV, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    result = launch_script("launch/train.py", "--config=configs/qwen3_4b.py", "--config.mesh.fsdp=1", env=offline)
    assert result.returncode == 1 and result.stderr.startswith(
        "error: ConfigError: config.model.path='Qwen/Qwen3-4B': Qwen/Qwen3-4B is not (completely) in the Hugging "
        "Face cache"
    )
    assert "HF_HUB_OFFLINE is set" in result.stderr and "Traceback" not in result.stderr
    result = train("--config.model.path=")
    assert result.returncode == 1 and "config.model.path='': this preset needs an HF checkpoint" in result.stderr
    assert result.stderr.startswith("error: ConfigError: ") and "Traceback" not in result.stderr
    result = train(f"--config.model.path={tmp_path / 'nope'}")
    assert result.returncode == 1 and "config.model.path=" in result.stderr and "does not exist" in result.stderr
    result = train(f"--config.model.path={tmp_path}", f"--config.data.path={tmp_path / 'dapo.parquet'}")
    assert result.returncode == 1 and "config.data.path=" in result.stderr and "dapo-math-17k.parquet" in result.stderr
    result = train(
        f"--config.model.path={tmp_path}", "--config.method=compo", "--verbosity=1"
    )  # the traceback on request
    assert result.returncode == 1 and "Traceback" in result.stderr and "pass --config.method=comppo" in result.stderr


@pytest.mark.slow
def test_qwen3_preset_runs_two_steps_on_a_tiny_checkpoint_and_small_data(tmp_path, hf_checkpoint):
    source, _ = hf_checkpoint("qwen3", True)
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(source, checkpoint)
    save_word_tokenizer(checkpoint, [str(d) for d in range(10)] + ["What", "is", "+", "?", "Answer", ":"])
    data = tmp_path / "dapo.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1 ?", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    arch = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        dtype="float32",
    )
    result = launch_script(  # a whole run, which starts JAX's backend: launch_quick's forks are for errors
        "launch/train.py",
        "--config=configs/qwen3_4b.py",
        f"--config.model.path={checkpoint}",
        f"--config.data.path={data}",
        f"--config.output_dir={tmp_path / 'run'}",
        *(f"--config.model.arch.{k}={v}" for k, v in arch.items()),
        "--config.data.dev_size=2",
        "--config.steps=2",
        "--config.rollout.max_new_tokens=6",
        "--config.rollout.prompts_per_step=2",
        "--config.rollout.samples_per_prompt=2",
        "--config.train.minibatch_size=2",
        "--config.train.critic_warmup_steps=0",
        "--config.train.eval_every=1",
        "--config.critic.bottleneck=8",
        "--config.reward.workers=1",
        "--config.progress=False",
        "--config.mesh.fsdp=1",
        "--config.mesh.tensor=1",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all("policy_loss" in s and "value_loss" in s for s in steps)
