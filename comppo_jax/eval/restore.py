"""A training run's policy back from its output_dir, for evaluation and notebooks.

    run = restore_policy("runs/tiny", step="best")   # the run's own config.json, its best checkpoint
    run.params, run.model_config, run.tokenizer, run.cfg, run.step

Only the actor params are read (verified against their digests, into `cfg.mesh`'s shardings) and
cast to the compute dtype; optimizer states and the critic stay on disk. `restore_actor` does the
same from a `RunCheckpoints` the caller already holds (launch/eval.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from comppo_jax import sharding
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.models import ModelConfig, init_params, model_config
from comppo_jax.train.checkpoint import RunCheckpoints
from comppo_jax.train.outputs import load_run_config
from comppo_jax.train.update import cast_params


class RestoredPolicy(NamedTuple):
    cfg: Any  # the run's ml_collections config
    step: int  # the checkpoint restored (steps count from 1; comppo_jax.train.outputs)
    model_config: ModelConfig
    params: dict  # in model_config.dtype
    tokenizer: Any


def actor_target(mesh, cfg, policy_config: ModelConfig):
    """The abstract actor a checkpoint holds: the policy's shapes in the master dtype, sharded on `mesh`."""
    return sharding.abstract_sharded(mesh, lambda: cast_params(init_params(policy_config, jax.random.PRNGKey(0)), cfg.train.master_dtype))


def restore_actor(cfg, checkpoints: RunCheckpoints, step: int) -> tuple[ModelConfig, dict]:
    """(model config, actor params in its compute dtype) of saved checkpoint `step`, on `cfg.mesh`."""
    policy_config = model_config(cfg.model)
    target = actor_target(sharding.run_meshes(cfg.mesh)[0], cfg, policy_config)
    return policy_config, cast_params(checkpoints.restore_params({"actor": target}, step)["actor"], policy_config.dtype)


def restore_policy(run_dir: str, step: str | int = "best", cfg=None) -> RestoredPolicy:
    """Checkpoint `step` ("latest", "best" by dev accuracy, or a saved step number) of the run in
    `run_dir`; `cfg` defaults to the run's own config.json (comppo_jax.train.outputs.load_run_config)."""
    cfg = load_run_config(run_dir) if cfg is None else cfg
    checkpoints = RunCheckpoints(run_dir, read_only=True)
    try:
        step = checkpoints.resolve_step(step)
        policy_config, params = restore_actor(cfg, checkpoints, step)
    finally:
        checkpoints.close()
    return RestoredPolicy(cfg, step, policy_config, params, load_tokenizer(cfg.model.tokenizer or cfg.model.path))
