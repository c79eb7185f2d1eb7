"""A training run's policy back from its output_dir, for evaluation and notebooks.

    run = restore_policy("runs/tiny", step="best")   # the run's own config.json, its best checkpoint
    run.params, run.model_config, run.tokenizer, run.cfg, run.step

Only the actor params are read (verified against their digests, into `cfg.mesh`'s shardings; a
LoRA run's adapters joined to its verified base) and cast to the compute dtype; optimizer states
and the critic stay on disk. `restore_actor` does the
same from a `RunCheckpoints` the caller already holds (launch/eval.py).

A warm-started run's base (its reference policy; a LoRA run's adapters sit on it) is read from
`reference/`; a lost or damaged one is rebuilt as a resume rebuilds it, by replaying the warm
start and checking it against the saved digests (comppo_jax.train.start.restore_reference).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import jax

from comppo_jax import sharding
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.models import ModelConfig, init_params, load_policy, lora, model_config
from comppo_jax.models.lora import LoraConfig
from comppo_jax.runs.checkpoint import RunCheckpoints, state_digests
from comppo_jax.train.methods import initial_keys
from comppo_jax.train.schema import load_run_config
from comppo_jax.train.specs import base_source, run_recipe, steps_of
from comppo_jax.train.start import kept_warm_start, load_encodable_problems, restore_reference
from comppo_jax.train.update import cast_params


class RestoredPolicy(NamedTuple):
    cfg: Any  # the run's ml_collections config
    step: int  # the checkpoint restored (steps count from 1; comppo_jax.runs.outputs)
    model_config: ModelConfig
    params: dict  # in model_config.dtype
    tokenizer: Any


def eval_meshes(mesh_config) -> tuple[Any, list | None]:
    """`sharding.run_meshes` on this machine: a run that rolled out on devices of its own
    (mesh.rollout_devices) and does not fit here is refused naming the flag that evaluates it."""
    try:
        return sharding.run_meshes(mesh_config)
    except ValueError as error:
        if not mesh_config.get("rollout_devices", 0):
            raise
        raise ValueError(
            f"{error}: evaluation needs no rollout devices of its own; pass --config.mesh.rollout_devices=0 to "
            "decode on this machine's devices as one mesh"
        ) from error


def policy_digest(params) -> str:
    """One digest of a policy's weights (its leaves' checkpoint digests, hashed together): what the
    weights are, not which step saved them; the same on every mesh."""
    digests, _ = state_digests(params)
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]


def actor_target(mesh, cfg, policy_config: ModelConfig):
    """The abstract actor a checkpoint holds, sharded on `mesh` in the master dtype: the policy's
    weights, or a LoRA run's adapters (comppo_jax.models.lora)."""
    adapters = LoraConfig.of(cfg.model)
    if adapters.enabled:
        return sharding.abstract_sharded(
            mesh, lambda: lora.init_adapters(policy_config, adapters, jax.random.PRNGKey(0), cfg.train.master_dtype)
        )
    return sharding.abstract_sharded(
        mesh, lambda: cast_params(init_params(policy_config, jax.random.PRNGKey(0)), cfg.train.master_dtype)
    )


def run_base(cfg, checkpoints: RunCheckpoints, mesh, policy_config: ModelConfig) -> dict:
    """The frozen policy a run started from, in the compute dtype on `mesh` (the reference policy;
    a LoRA run's base): its saved warm-started policy, else model.path or model.arch at random
    from the run's seed, as train() built it."""
    shapes = sharding.abstract_sharded(mesh, lambda: init_params(policy_config, jax.random.PRNGKey(0)))
    if cfg.warm_start.steps:
        return restore_reference(checkpoints, mesh, shapes, lambda: replayed_warm_start(cfg, checkpoints.directory))
    params = cast_params(load_policy(cfg.model, initial_keys(cfg.seed)[0])[1], policy_config.dtype)
    return sharding.put(params, jax.tree.map(lambda x: x.sharding, shapes))


def replayed_warm_start(cfg, run_directory) -> dict:
    """The run's warm-started policy in the compute dtype, as train() made it: read back from its
    warm-start file, else the warm start run again."""
    loaded_config, initial = load_policy(cfg.model, initial_keys(cfg.seed)[0])
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    train_problems = load_encodable_problems(cfg, tokenizer)[0]
    params, _ = kept_warm_start(cfg, run_directory, initial, loaded_config, tokenizer, train_problems)
    return cast_params(params, loaded_config.dtype)


def with_run_base(cfg, checkpoints: RunCheckpoints, mesh, policy_config: ModelConfig, actor: dict) -> dict:
    """A restored actor entry as a whole policy: a LoRA run's adapters joined to its base, which
    must be the one they were trained on (base.json); full fine-tuning's weights as they are."""
    if not LoraConfig.of(cfg.model).enabled:
        return actor
    base = run_base(cfg, checkpoints, mesh, policy_config)
    checkpoints.verify_base(base, base_source(cfg))
    return lora.join(base, actor)


def restored_actor(cfg, checkpoints: RunCheckpoints, step: int, mesh, policy_config: ModelConfig) -> dict:
    """The actor of saved checkpoint `step` on `mesh`, as saved (the master dtype; a LoRA run's
    adapters joined, unmerged, to its verified base)."""
    actor = checkpoints.restore_params({"actor": actor_target(mesh, cfg, policy_config)}, step)["actor"]
    return with_run_base(cfg, checkpoints, mesh, policy_config, actor)


def restore_actor(cfg, checkpoints: RunCheckpoints, step: int, mesh=None) -> tuple[ModelConfig, dict]:
    """(model config, actor params in its compute dtype) of saved checkpoint `step`, on `mesh`
    (default: `cfg.mesh`'s training mesh; a LoRA run's adapters on their base, unmerged)."""
    policy_config = model_config(cfg.model)
    mesh = eval_meshes(cfg.mesh)[0] if mesh is None else mesh
    actor = restored_actor(cfg, checkpoints, step, mesh, policy_config)
    return policy_config, cast_params(actor, policy_config.dtype)


def resolve_step(checkpoints: RunCheckpoints, step: str | int, cfg) -> int:
    """`checkpoints.resolve_step(step)`, where step=best finds checkpoints but none saved at a dev evaluation
    saying why from the run's config `cfg` (its steps ended before the first evaluation, say) and what to pass."""
    latest = checkpoints.latest_step()
    if str(step) == "best" and checkpoints.best_step() is None and latest is not None:
        raise FileNotFoundError(
            f"step=best: the run in {checkpoints.directory} has checkpoints but none was saved at a dev evaluation "
            f"({_why_not_evaluated(cfg, latest)}); pass --step=latest (step {latest}) or a saved step number"
        )
    return checkpoints.resolve_step(step)


def _why_not_evaluated(cfg, latest: int) -> str:
    every = cfg.train.eval_every
    if not every:
        return "train.eval_every=0: it never evaluates"
    first = steps_of(cfg, run_recipe(cfg)).prepended + every  # as RecorderSpec.evaluates counts
    if latest < first:
        return (
            f"its steps ended at {latest}, before its first dev evaluation at step {first} (train.eval_every={every})"
        )
    if not cfg.checkpoint.keep_best:
        return "checkpoint.keep_best=0 keeps none of the evaluated ones"
    return "a run older than the rule that saves a checkpoint at each dev evaluation"


def restore_policy(run_dir: str, step: str | int = "best", cfg=None) -> RestoredPolicy:
    """Checkpoint `step` ("latest", "best" by dev accuracy, or a saved step number) of the run in
    `run_dir`; `cfg` defaults to the run's own config.json (comppo_jax.runs.outputs.load_run_config)."""
    cfg = load_run_config(run_dir) if cfg is None else cfg
    checkpoints = RunCheckpoints(run_dir, read_only=True)
    try:
        step = resolve_step(checkpoints, step, cfg)
        policy_config, params = restore_actor(cfg, checkpoints, step)
    finally:
        checkpoints.close()
    return RestoredPolicy(cfg, step, policy_config, params, load_tokenizer(cfg.model.tokenizer or cfg.model.path))
