"""A run's start: the run directory's checks, the loaded data and policy, the warm start, and the
state the stages start from, a new run's or a resumed one's (comppo_jax.train.loop runs them).

- `resume_check`: before anything loads, refuses a resume with nothing to resume or whose config
  changes what the run computes, a new run in a directory holding one, and a resume whose LoRA
  setting is not the run's; `completed_summary`: a finished run's summary, nothing left to do.
- `starting_point`: the problems, the tokenizer, the policy, the warm start (read back where it is
  kept, else run), the reference, the critic, the optimizer states, on the training mesh; a resume
  restores the newest checkpoint that verifies (`restore_migrating`: at another rollout.staleness
  its in-flight batches are migrated).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from absl import logging

from comppo_jax import sharding, storage
from comppo_jax.data.datasets import encodable_problems, load_dapo_math
from comppo_jax.data.synthetic import Noise, chained_arithmetic
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.models import CheckpointError, ConfigError, load_policy, lora
from comppo_jax.models.lora import LoraConfig
from comppo_jax.runs import run_dir
from comppo_jax.runs.checkpoint import BASE_RECORD, CheckpointMismatchError, RunCheckpoints
from comppo_jax.train.guards import StopSignals
from comppo_jax.train.learner import Offload
from comppo_jax.train.methods import init_critic, initial_keys
from comppo_jax.train.recorder import initial_meta
from comppo_jax.train.schema import CONFIG_FILE, load_run_config, save_run_config
from comppo_jax.train.specs import RunSpec, base_source
from comppo_jax.train.update import adamw, cast_params
from comppo_jax.train.warm_start import LENGTH_BUCKET, cached_warm_start, warm_start


def load_problems(data, seed: int):
    """(train, dev) problems for the config's `data` section."""
    if data.kind == "synthetic":
        problems = chained_arithmetic(
            data.train_size + data.dev_size,
            seed=seed,
            min_steps=data.min_steps,
            max_steps=data.max_steps,
            operations=data.operations,
        )
        return problems[: data.train_size], problems[data.train_size :]
    if data.kind == "dapo_math":
        return load_dapo_math(data.path, dev_size=data.dev_size, seed=seed)
    raise ValueError(f"config.data.kind={data.kind!r}; expected 'synthetic' or 'dapo_math'")


def load_encodable_problems(cfg, tokenizer):
    """(train, dev) problems without the rows the tokenizer cannot encode (skipped and counted)."""
    train_problems, dev_problems = load_problems(cfg.data, cfg.seed)
    where = cfg.data.path or f"the {cfg.data.kind} data"
    longest_prompt = cfg.model.arch.max_position_embeddings - cfg.rollout.max_new_tokens
    return (
        encodable_problems(tokenizer, train_problems, f"{where} (train)", max_prompt_tokens=longest_prompt),
        encodable_problems(tokenizer, dev_problems, f"{where} (dev)", max_prompt_tokens=longest_prompt),
    )


def warm_start_key(cfg) -> dict:
    """Everything the warm-started policy depends on (its cache key): not LoRA, whose adapters
    train on top of it, so runs of any rank share one warm start."""
    settings = {k: v for k, v in cfg.warm_start.to_dict().items() if k != "cache_dir"}
    if not settings["step_noise"]:  # added later: off, the key (and so every kept warm start) is as before
        del settings["step_noise"], settings["noisy_operands"]
    for later in ("tool_calls", "noisy_first_steps", "mark_mistakes"):  # the same, each at its default
        if not settings.get(later):
            settings.pop(later, None)
    settings["length_bucket"] = LENGTH_BUCKET  # the padding changes the float sums
    model = {k: v for k, v in cfg.model.to_dict().items() if k != "lora"}
    return {"model": model, "data": cfg.data.to_dict(), "warm_start": settings, "seed": cfg.seed}


def kept_warm_start(
    cfg, run_directory, actor, model_config, tokenizer, train_problems, progress=False, check_stop=None
):
    """(params, loss) of the run's warm start from `actor`: read back where it is kept
    (warm_start.cache_dir, else `run_directory`), else run and kept there the moment it ends."""
    return cached_warm_start(
        cfg.warm_start.cache_dir or run_directory,
        warm_start_key(cfg),
        actor,
        lambda: warm_start(
            actor,
            model_config,
            tokenizer,
            train_problems,
            steps=cfg.warm_start.steps,
            batch_size=cfg.warm_start.batch_size,
            learning_rate=cfg.warm_start.learning_rate,
            seed=cfg.seed,
            noise=Noise.of(cfg.warm_start),
            progress=progress,
            check_stop=check_stop,
        ),
    )


def restore_reference(checkpoints: RunCheckpoints, mesh, actor, replay):
    """The run's saved reference policy. A missing or damaged one is rebuilt from `replay()` (the
    warm start: read back from its cache, else run again, frozen in the compute dtype) and kept
    only if it matches the saved digests (RunCheckpoints.rebuild_reference)."""
    try:
        return checkpoints.restore_reference(sharding.abstract_sharded(mesh, lambda: actor))
    except (FileNotFoundError, CheckpointError) as error:
        logging.warning("%s: rebuilding it by replaying the warm start", error)
    rebuilt = replay()
    rebuilt = sharding.put(rebuilt, sharding.tree_shardings(mesh, rebuilt))
    checkpoints.rebuild_reference(rebuilt)
    return rebuilt


def restore_for_resume(cfg, checkpoints: RunCheckpoints, state):
    """(state, meta) to continue from: `resume_step`, or the newest checkpoint that verifies. `state`:
    the target, or a function of the step that returns it (RunCheckpoints.restore)."""
    if cfg.resume_step < 0:
        state, meta, _ = checkpoints.restore_newest_good(state)
        return state, meta
    try:
        return checkpoints.restore(state, cfg.resume_step)
    except CheckpointMismatchError:  # another state structure: no older checkpoint fits better
        raise
    except CheckpointError as error:
        raise CheckpointError(
            f"{error}; pass --config.resume_step=-1 to resume from the newest checkpoint that verifies"
        ) from error


def completed_summary(cfg, checkpoints: RunCheckpoints, last_step: int, main_process: bool) -> dict | None:
    """The stored summary of a finished run (its newest checkpoint is its last step and summary.json
    exists), said in one line; None when there is something left to run."""
    latest = checkpoints.latest_step()
    if latest is not None and latest > last_step:
        raise ConfigError(
            f"{cfg.output_dir} has checkpoint {latest}, past this config's last step {last_step}: raise config.steps "
            "to continue it, or choose another --config.output_dir"
        )
    path = storage.path(cfg.output_dir) / "summary.json"
    if latest != last_step or not path.exists():
        return None
    try:
        summary = json.loads(storage.read_text(path))
        if not isinstance(summary, dict):
            raise ValueError(f"a JSON {type(summary).__name__}, not an object")
    except (OSError, ValueError, UnicodeDecodeError) as error:  # torn by a crash, emptied, overwritten
        logging.warning(
            "%s cannot be read (%s: %s): the run is not taken as complete; resuming from checkpoint %d "
            "to run its final dev evaluation again and rewrite it",
            path,
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
            last_step,
        )
        return None
    if main_process:
        print(f"run already complete at step {last_step}: nothing to do ({path})", flush=True)
    return summary


def resume_check(cfg, checkpoints: RunCheckpoints) -> list[dict]:
    """Before anything loads: refuses a resume with nothing to resume, or whose config changes what
    the run computes (comppo_jax.runs.run_dir), and a new run in a directory holding one. Returns
    the resume's accepted config changes."""
    if not cfg.resume:
        if checkpoints.latest_step() is not None:
            raise FileExistsError(
                f"{cfg.output_dir} already has checkpoints (latest step {checkpoints.latest_step()}): "
                "pass --config.resume=True to continue that run, or choose another --config.output_dir"
            )
        if checkpoints.set_aside():
            raise FileExistsError(
                f"{cfg.output_dir} holds an earlier run's checkpoints set aside as damaged: "
                f"{checkpoints.set_aside_note()}"
            )
        return []
    if checkpoints.latest_step() is None:
        raise FileNotFoundError(checkpoints.no_checkpoint_message())
    if not (storage.path(cfg.output_dir) / CONFIG_FILE).exists():
        logging.warning(
            "%s has no %s to compare this resume's config with; it is written now", cfg.output_dir, CONFIG_FILE
        )
        changes = []
    else:
        changes = run_dir.resume_changes(cfg, load_run_config(cfg.output_dir))
    check_lora_resume(cfg, checkpoints)
    return changes


def check_lora_resume(cfg, checkpoints: RunCheckpoints) -> None:
    """Refuses, before anything loads, a resume whose LoRA setting is not the run's: adapters on a
    run that trained every weight (it never wrote base.json, and its checkpoints hold the full
    policy), or full fine-tuning of a LoRA run (its checkpoints hold the adapters only)."""
    record = storage.path(cfg.output_dir) / BASE_RECORD
    enabled = LoraConfig.of(cfg.model).enabled
    if enabled == record.exists():
        return
    latest = checkpoints.latest_step()
    try:
        holds_adapters = any(lora.is_adapter(path.strip("[]'")) for path in _leaf_names(checkpoints, latest))
    except CheckpointError:  # a damaged newest checkpoint: restore_newest_good names it and falls back
        return
    if enabled and not holds_adapters:
        raise ConfigError(
            f"config.model.lora.rank={cfg.model.lora.rank}: {cfg.output_dir} was not a LoRA run (no {BASE_RECORD} "
            f"was ever written there, and checkpoint {latest} holds the full policy, not adapters): resume it "
            "with --config.model.lora.rank=0, or start a LoRA run with another --config.output_dir"
        )
    if not enabled and holds_adapters:
        raise ConfigError(
            f"config.model.lora.rank=0: {cfg.output_dir} is a LoRA run (checkpoint {latest} holds adapters only, "
            f"beside the base recorded in {record}): resume it with its own config.model.lora, or start a full "
            "fine-tuning run with another --config.output_dir"
        )


def _leaf_names(checkpoints: RunCheckpoints, step: int) -> list[str]:
    """The last key of every leaf path of checkpoint `step`'s actor ("q_proj_lora_a", ...)."""
    tree = checkpoints.saved_tree(step)
    actor = tree.get("actor", {}) if isinstance(tree, dict) else {}
    return [jax.tree_util.keystr(path[-1:]) for path, _ in jax.tree_util.tree_flatten_with_path(actor)[0]]


def checkpointed(state: dict) -> dict:
    """What a checkpoint holds of `state`: the actor's and the in-flight policies' trainable part
    (a LoRA run's adapters; its frozen base is recorded once, comppo_jax.runs.checkpoint)."""
    saved = {**state, "actor": lora.trainable(state["actor"])}
    if "behaviour" in state:
        saved["behaviour"] = [lora.trainable(policy) for policy in state["behaviour"]]
    return saved


def with_base(state: dict, base) -> dict:
    """`checkpointed`'s inverse: a restored state's policies on the frozen `base` (None: full fine-tuning)."""
    joined = {**state, "actor": lora.join(base, state["actor"])}
    if "behaviour" in state:
        joined["behaviour"] = [lora.join(base, policy) for policy in state["behaviour"]]
    return joined


def restore_migrating(cfg, checkpoints: RunCheckpoints, state: dict, snapshot: Callable, config_changes: list[dict]):
    """(state, meta) of the checkpoint to resume from (`restore_for_resume`), with as many in-flight
    policies as that checkpoint holds (its rollout.staleness, which may differ from this config's:
    comppo_jax.train.staleness migrates them). A checkpoint of another state structure is refused
    in one line (CheckpointMismatchError), naming the accepted config changes that made it."""
    template = []  # the in-flight policies' target, made once: a compute-dtype copy of the actor

    def target(step: int) -> dict:
        count = checkpoints.saved_list_length(step, "behaviour")
        if count and not template:
            template.append(snapshot(state["actor"]))
        return checkpointed({**state, **({"behaviour": template * count} if count else {})})

    try:
        return restore_for_resume(cfg, checkpoints, target)
    except CheckpointMismatchError as error:
        accepted = [change for change in config_changes if change["accepted"] == "resume_allow_changes"]
        if not accepted:
            raise
        listed = ", ".join(f"{c['field']}: {c['old']!r} -> {c['new']!r}" for c in accepted)
        raise CheckpointMismatchError(
            f"{error}. This resume's accepted change(s) ({listed}) change the state a checkpoint holds, which a "
            "resume refuses rather than migrates (only rollout.staleness is migrated): resume without them, or start "
            "a new run with another --config.output_dir"
        ) from error


class StartingPoint(NamedTuple):
    """What a run starts its stages from: a new run's initial state or a resumed run's restored one."""

    model_config: Any
    tokenizer: Any
    problems: tuple[list, list]  # (train, dev)
    state: dict  # actor, actor_opt, critic, critic_opt, rng: on the training mesh
    meta: dict  # recorder.initial_meta()'s fields, as restored
    # () -> the frozen reference policy (fetched from host memory with train.offload_idle; a LoRA run's base)
    reference: Callable
    # actor -> a fresh compute-dtype copy on the training mesh (the generating policy of a batch started ahead)
    snapshot: Callable
    behaviour: list  # a resumed run's policies of the batches in flight (rollout.staleness), else []
    actor_tx: Any
    critic_tx: Any
    offload: Offload


def starting_point(
    cfg,
    spec: RunSpec,
    mesh,
    stop: StopSignals,
    checkpoints: RunCheckpoints,
    config_changes: list[dict],
    show_progress: bool,
) -> StartingPoint:
    """Loads the data and the policy, runs (or reads back) the warm start, and builds the state: a
    new run's, or a resumed run's from its checkpoint (config.json rewritten with its changes)."""
    main_process = jax.process_index() == 0
    policy_rng, critic_rng, rng = initial_keys(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)  # "" and no path: the character tokenizer
    train_problems, dev_problems = load_encodable_problems(cfg, tokenizer)
    model_config, actor = load_policy(cfg.model, policy_rng)
    meta = initial_meta()
    run_warm_start = lambda: kept_warm_start(
        cfg, cfg.output_dir, actor, model_config, tokenizer, train_problems, show_progress, stop.check
    )
    # The reference is frozen in the compute dtype; the actor trains in the master dtype. With LoRA
    # the reference is also the base the adapters (in the master dtype) train beside.
    frozen = lambda params: jax.tree.map(lambda p: jnp.array(p, dtype=model_config.dtype, copy=True), params)
    if cfg.warm_start.steps and cfg.resume:
        reference = restore_reference(checkpoints, mesh, actor, lambda: frozen(run_warm_start()[0]))
    elif cfg.warm_start.steps:
        actor, warm_start_loss = run_warm_start()
        meta["warm_start_loss"] = float(warm_start_loss)
        reference = frozen(actor)
    else:
        reference = frozen(actor)
    adapters = LoraConfig.of(cfg.model)
    if adapters.enabled:
        actor = lora.join(
            reference,
            lora.init_adapters(model_config, adapters, jax.random.fold_in(policy_rng, 1), cfg.train.master_dtype),
        )
    else:
        actor = cast_params(actor, cfg.train.master_dtype)
    critic = init_critic(
        spec.learner.credit, model_config, critic_rng, policy=reference, master_dtype=cfg.train.master_dtype
    )
    actor_tx, critic_tx = adamw(cfg.train.actor_lr), adamw(cfg.train.critic_lr)
    state = {
        "actor": actor,
        "actor_opt": jax.jit(actor_tx.init)(lora.trainable(actor)),  # one program, not an op per leaf
        "critic": critic,
        "critic_opt": None if critic is None else jax.jit(critic_tx.init)(critic),
        "rng": rng,
    }
    state = sharding.put(state, sharding.tree_shardings(mesh, state))
    base = lora.split(state["actor"])[1]  # None without adapters
    if base is not None:
        (checkpoints.verify_base if cfg.resume else checkpoints.record_base)(base, base_source(cfg))
    compute = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, model_config.dtype), lora.trainable(state["actor"]))
    cast = jax.jit(
        lambda trainable: cast_params(trainable, model_config.dtype),
        out_shardings=sharding.tree_shardings(mesh, compute),
    )
    snapshot = lambda actor: lora.join(
        base, cast(lora.trainable(actor))
    )  # a LoRA run's snapshots share its frozen base
    behaviour = []
    if cfg.resume:  # into the mesh's shardings: every process reads its own shards
        state, meta = restore_migrating(cfg, checkpoints, state, snapshot, config_changes)
        state = with_base(state, base)
        behaviour = state.pop("behaviour", [])
        if main_process:
            print(
                f"resuming from step {meta['step']} of {spec.steps.total} "
                f"({checkpoints.steps_directory}/{meta['step']})",
                flush=True,
            )
            save_run_config(cfg, cfg.output_dir)
            run_dir.record_changes(cfg.output_dir, meta["step"], config_changes)
    reference = base if base is not None else sharding.put(reference, sharding.tree_shardings(mesh, reference))
    if cfg.warm_start.steps and not cfg.resume:  # saved once it is a global array (every process writes its shards)
        checkpoints.save_reference(reference)
    offload = Offload.of(cfg.train.offload_idle)
    state["actor_opt"] = offload.park(state["actor_opt"])
    if base is not None:  # the actor's own base: nothing to park or fetch
        fetch_reference = lambda: base
    else:
        parked = offload.park(reference)
        fetch_reference = lambda: offload.fetch(parked)
    return StartingPoint(
        model_config,
        tokenizer,
        (train_problems, dev_problems),
        state,
        meta,
        fetch_reference,
        snapshot,
        behaviour,
        actor_tx,
        critic_tx,
        offload,
    )
