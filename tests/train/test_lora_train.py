"""LoRA through train(): the state holds the base once (the reference policy is the actor's own base
arrays), AdamW covers the adapters, checkpoints hold the adapters only, a resume equals the straight
run bitwise on a sharded mesh, a resume on another base is refused, and every method trains."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import pytest
from conftest import (
    WALL_CLOCK,
    assert_same_checkpoint_state,
    fake_devices_env,
    launch_script,
    small_train_config,
    small_train_flags,
)

from comppo_jax.models import lora
from comppo_jax.runs.checkpoint import BASE_RECORD, RunCheckpoints

LORA = dict(model__lora__rank=4, model__lora__targets="q,v,gate,down", train__actor_lr=1e-2)


def test_a_lora_run_starts_with_one_base_which_is_its_reference_and_adamw_over_the_adapters(tmp_path):
    from comppo_jax.models import model_config
    from comppo_jax.train.loop import training_mesh
    from comppo_jax.train.specs import resolve
    from comppo_jax.train.start import starting_point

    cfg = small_train_config(
        tmp_path, warm_start__steps=0, train__master_dtype="float32", model__arch__dtype="bfloat16", **LORA
    )
    mesh, _ = training_mesh(cfg)
    checkpoints = RunCheckpoints(cfg.output_dir)
    start = starting_point(cfg, resolve(cfg, model_config(cfg.model)), mesh, None, checkpoints, [], show_progress=False)
    actor = start.state["actor"]
    adapters, base = lora.split(actor)
    assert set(adapters["layers"]) == {f"{w}_proj_lora_{p}" for w in ("q", "v", "gate", "down") for p in "ab"}
    assert all(a is b for a, b in zip(jax.tree.leaves(start.reference()), jax.tree.leaves(base)))  # no second copy
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}  # frozen in the compute dtype
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}  # trained in the master dtype
    assert jax.tree.structure(start.state["actor_opt"].inner_state[0].mu) == jax.tree.structure(adapters)
    record = json.loads((tmp_path / BASE_RECORD).read_text())
    assert record["source"] == "model.arch at random (seed 0)" and len(record["digests"]) == len(jax.tree.leaves(base))
    checkpoints.close()


def launch(run, **overrides):
    """launch/train.py on 8 fake CPU devices."""
    return launch_script("launch/train.py", *small_train_flags(run, **overrides), env=fake_devices_env(8))


def metric_rows(run):
    return [
        {k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow
def test_a_sharded_lora_run_resumed_mid_run_equals_the_straight_run_and_refuses_another_base(tmp_path):
    # 8 devices, data 2 x fsdp 2 x tensor 2: the adapters sharded as their base weights, decoding the merged
    # weights in its own layout.
    sharded = dict(
        LORA, steps=3, mesh__data=2, mesh__fsdp=2, mesh__tensor=2, rollout__prompts_per_step=4, train__minibatch_size=4
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = launch(straight, **sharded)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(
        straight / "checkpoints" / "4" / "meta" / "metadata"
    ) as f:  # the checkpoint's leaves: the adapters, not the base
        actor_leaves = [leaf for leaf in json.load(f)["digests"] if leaf.startswith("['actor']")]
    assert actor_leaves and all("_lora_" in leaf for leaf in actor_leaves), actor_leaves
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    (resumed / "summary.json").unlink()
    result = launch(resumed, resume=True, **sharded)
    assert result.returncode == 0, result.stderr[-3000:]
    assert metric_rows(resumed) == metric_rows(straight)
    assert_same_checkpoint_state(straight, resumed, 4)

    # Another base under the same adapters (here: the record of the original says other weights) is refused,
    # nothing lost.
    record = json.loads((resumed / BASE_RECORD).read_text())
    leaf = sorted(record["digests"])[0]
    record["digests"][leaf] = "0" * 16
    (resumed / BASE_RECORD).write_text(json.dumps(record))
    shutil.rmtree(resumed / "checkpoints" / "4")
    result = launch(resumed, resume=True, **sharded)
    assert result.returncode != 0 and "is not the one this run's LoRA adapters were trained on" in result.stderr, (
        result.stderr[-2000:]
    )
    assert (resumed / "checkpoints" / "3").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "ppo"])
def test_every_method_trains_lora_adapters(tmp_path, method):
    from comppo_jax.train.loop import train

    # In this process: the second method reuses the first's compiled sampler and scoring (22.7 -> 10.8 s here).
    train(small_train_config(tmp_path, method=method, **LORA))
    rows = metric_rows(tmp_path)
    assert all(row["actor_finite"] if "actor_finite" in row else True for row in rows) and rows[-1]["grad_norm"] > 0


class Loaded(Exception):
    """train() got past the run directory's checks to its first load."""


def saved_run(run, actor: dict, **overrides):
    """A run directory as train() leaves it after checkpoint 1 (its config.json and one checkpoint of `actor`)."""
    from comppo_jax.train.schema import save_run_config

    save_run_config(small_train_config(run, **overrides), str(run))
    checkpoints = RunCheckpoints(str(run), keep_last=2, keep_best=0)
    checkpoints.save(1, {"actor": actor}, {"step": 1})
    checkpoints.close()


def test_lora_on_a_run_that_trained_every_weight_and_the_reverse_are_refused_before_anything_loads(
    tmp_path, monkeypatch
):
    from comppo_jax.models import ConfigError
    from comppo_jax.train import loop

    def reached(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr("comppo_jax.train.start.load_tokenizer", reached)
    full, adapted = tmp_path / "full", tmp_path / "lora"
    saved_run(full, {"layers": {"q_proj": jnp.zeros((2, 4, 4))}})
    with pytest.raises(
        ConfigError,
        match=r"^config\.model\.lora\.rank=4: .*/full was not a LoRA run \(no base\.json was ever written there, and "
        r"checkpoint 1 holds the full policy, not adapters\): resume it with --config\.model\.lora\.rank=0",
    ) as refused:
        loop.train(small_train_config(full, resume=True, resume_allow_changes="model.lora,train", **LORA))
    assert "\n" not in str(refused.value) and "restore it from a backup" not in str(refused.value)
    assert not (full / BASE_RECORD).exists() and not (full / "corrupt_checkpoints").exists()
    with pytest.raises(Loaded):  # the run's own config passes on to the loading
        loop.train(small_train_config(full, resume=True))

    saved_run(adapted, {"layers": {"q_proj_lora_a": jnp.zeros((2, 4, 1))}}, **LORA)
    (adapted / BASE_RECORD).write_text(json.dumps({"source": "model.arch at random (seed 0)", "digests": {}}))
    with pytest.raises(ConfigError, match=r"^config\.model\.lora\.rank=0: .*/lora is a LoRA run \(checkpoint 1 holds"):
        loop.train(small_train_config(adapted, resume=True, resume_allow_changes="model.lora,train"))
    # A LoRA run whose base.json is lost is not this: the resume goes on to the base check, which names the file.
    (adapted / BASE_RECORD).unlink()
    with pytest.raises(Loaded):
        loop.train(small_train_config(adapted, resume=True, **LORA))
