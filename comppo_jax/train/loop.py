"""The train loop as a schedule of three stages (paper algorithm 1):

    rollout:  sample -> reward -> dynamic sampling -> behaviour scoring    (comppo_jax.train.rollout_stage)
    learner:  credit -> update (E epochs of minibatches) -> guards -> controller  (comppo_jax.train.learner)
    recorder: metrics -> checkpoints -> summary and plots                  (comppo_jax.train.recorder)

`train(cfg)` runs a whole job from an ml_collections config (see configs/tiny.py). Each step:
1. the rollout stage samples `samples_per_prompt` responses for `prompts_per_step` prompts (the
   paged KV-cache engine, in the decode layout), verifies their answers (math-verify in killable
   workers) with the scheduled shaping, keeps informative groups (dynamic sampling), and scores
   them with the behaviour policy (log-probs, H -> c -> kappa, critic features) and the frozen
   reference policy (log-probs): one `Experience`;
2. the learner assigns credit (the method's gate control, critic values and estimator,
   comppo_jax.train.methods; whitened, clipped advantages) and updates: actor clipped PPO + KL
   and critic clipped value regression over minibatches, with the phase controller's knobs; the
   actor waits during the critic warm-up (extra steps on top of `steps` unless
   train.critic_warmup_counts_toward_steps); then the controller reads the step's metrics;
3. the recorder writes the metrics (JSONL, TensorBoard) and, every `checkpoint.every` steps, at
   every dev evaluation (so keep_best keeps the best evaluated policy) and at the end, starts an
   async Orbax checkpoint.
At the start (`starting_point`): the run directory's lock and config.json (the whole config;
comppo_jax.train.outputs.load_run_config reads it; a resume compares against it first,
comppo_jax.train.run_dir), the warm start and the state. At the end: summary.json, curves.png
and gate_profile.json (the run's mean gate per position bin).

Params, optimizer states and batches live on a (data, fsdp, tensor) mesh (comppo_jax.sharding);
the update steps are jitted with explicit in/out shardings. `config.resume=True` restores the
latest checkpoint and continues exactly where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import tqdm
from absl import logging

from comppo_jax import sharding
from comppo_jax.data.rewards import VerifierPool
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.models import CheckpointError, ConfigError, load_policy
from comppo_jax.train import controller, decode_layout, run_dir
from comppo_jax.train.checkpoint import RunCheckpoints, committed_steps
from comppo_jax.train.guards import RunStopped, StopSignals
from comppo_jax.train.learner import Learner, Offload
from comppo_jax.train.methods import RunParts, actor_loss_of, init_critic, kl_term, recipe as make_recipe, run_parts, total_steps
from comppo_jax.train.outputs import CONFIG_FILE, load_run_config, save_run_config
from comppo_jax.train.recorder import Recorder, initial_meta
from comppo_jax.train.rollout_stage import RolloutStage, load_encodable_problems
from comppo_jax.train.staleness import RolloutQueue
from comppo_jax.train.update import adamw, cast_params, jit_update_steps, minibatch_shardings
from comppo_jax.train.validation import validate_config
from comppo_jax.train.warm_start import cached_warm_start, warm_start


def check_batch(cfg, mesh) -> None:
    """Fails before any work on batch sizes the mesh cannot split (validate_config checks the rest)."""
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    multiple = sharding.batch_size_multiple(mesh)
    for name, size in (("train.minibatch_size", cfg.train.minibatch_size), ("rollout.prompts_per_step * samples_per_prompt", rows)):
        if size % multiple:
            raise ConfigError(f"config.{name}={size} must be a multiple of mesh data x fsdp = {multiple}; change it or config.mesh")


def warm_start_key(cfg) -> dict:
    """Everything the warm-started policy depends on (its cache key)."""
    settings = {k: v for k, v in cfg.warm_start.to_dict().items() if k != "cache_dir"}
    return {"model": cfg.model.to_dict(), "data": cfg.data.to_dict(), "warm_start": settings, "seed": cfg.seed}


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
    """(state, meta) to continue from: `resume_step`, or the newest checkpoint that verifies."""
    if cfg.resume_step < 0:
        state, meta, _ = checkpoints.restore_newest_good(state)
        return state, meta
    try:
        return checkpoints.restore(state, cfg.resume_step)
    except CheckpointError as error:
        raise CheckpointError(f"{error}; pass --config.resume_step=-1 to resume from the newest checkpoint that verifies") from error


def completed_summary(cfg, checkpoints: RunCheckpoints, last_step: int, main_process: bool) -> dict | None:
    """The stored summary of a finished run (its newest checkpoint is its last step and summary.json
    exists), said in one line; None when there is something left to run."""
    latest = checkpoints.latest_step()
    if latest is not None and latest > last_step:
        raise ConfigError(f"{cfg.output_dir} has checkpoint {latest}, past this config's last step {last_step}: raise config.steps "
                          "to continue it, or choose another --config.output_dir")
    path = os.path.join(cfg.output_dir, "summary.json")
    if latest != last_step or not os.path.exists(path):
        return None
    if main_process:
        print(f"run already complete at step {last_step}: nothing to do ({path})", flush=True)
    with open(path) as f:
        return json.load(f)


def first_call_notices(enabled: bool):
    """compiling(what): says "compiling <what>..." the first time each program is called (the first
    step compiles them all, for up to minutes at scale; later calls reuse them)."""
    said = set()

    def compiling(what: str) -> None:
        if enabled and what not in said:
            said.add(what)
            tqdm.tqdm.write(f"compiling {what}...")

    return compiling


def train(cfg) -> dict:
    """Runs (or, with `cfg.resume`, continues) the run's steps (`total_steps`); returns the summary,
    or, when a SIGTERM / SIGINT stopped it, {"stopped_at_step", "checkpoint"} ({"stopped_during"}
    when it stopped before its first checkpoint)."""
    validate_config(cfg)  # every field, before any loading or compiling
    sharding.initialize_distributed(cfg.mesh)
    mesh, rollout_devices = training_mesh(cfg)
    check_batch(cfg, mesh)
    decode_layout.check_config(cfg, mesh, rollout_devices)
    os.makedirs(cfg.output_dir, exist_ok=True)
    # One writer per run directory; from here on a SIGTERM / SIGINT stops the run cleanly.
    with run_dir.locked(cfg.output_dir), StopSignals() as stop:
        try:
            return run_training(cfg, mesh, rollout_devices, stop)
        except RunStopped as error:
            return stopped_early(cfg, error.stage)


def stopped_early(cfg, stage: str) -> dict:
    """A run stopped before the end of a step: its newest checkpoint (if any) is where it resumes."""
    steps = committed_steps(os.path.abspath(cfg.output_dir))
    if not steps:
        return {"stopped_during": stage}
    return {"stopped_at_step": max(steps), "stopped_during": stage,
            "checkpoint": os.path.join(os.path.abspath(cfg.output_dir), "checkpoints", str(max(steps)))}


def resume_check(cfg, checkpoints: RunCheckpoints) -> list[dict]:
    """Before anything loads: refuses a resume with nothing to resume, or whose config changes what
    the run computes (comppo_jax.train.run_dir), and a new run in a directory holding one. Returns
    the resume's accepted config changes."""
    if not cfg.resume:
        if checkpoints.latest_step() is not None:
            raise FileExistsError(f"{cfg.output_dir} already has checkpoints (latest step {checkpoints.latest_step()}): "
                                  "pass --config.resume=True to continue that run, or choose another --config.output_dir")
        if checkpoints.set_aside():
            raise FileExistsError(f"{cfg.output_dir} holds an earlier run's checkpoints set aside as damaged: "
                                  f"{checkpoints.set_aside_note()}")
        return []
    if checkpoints.latest_step() is None:
        raise FileNotFoundError(checkpoints.no_checkpoint_message())
    if not os.path.exists(os.path.join(cfg.output_dir, CONFIG_FILE)):
        logging.warning("%s has no %s to compare this resume's config with; it is written now", cfg.output_dir, CONFIG_FILE)
        return []
    return run_dir.resume_changes(cfg, load_run_config(cfg.output_dir))


def training_mesh(cfg) -> tuple:
    """(the training mesh, the rollout stage's own devices or None): with mesh.rollout_devices = r
    the last r devices of every process roll out and `config.mesh` lays out the others."""
    if not cfg.mesh.rollout_devices:
        return sharding.make_mesh(cfg.mesh), None
    try:
        train_devices, rollout_devices = sharding.split_devices(cfg.mesh.rollout_devices)
        return sharding.make_mesh(cfg.mesh, train_devices), rollout_devices
    except ValueError as error:
        raise ConfigError(str(error)) from error


def run_training(cfg, mesh, rollout_devices, stop: StopSignals) -> dict:
    """`train` inside the run directory's lock, with the stop signals installed: the state, the
    stages, then their schedule."""
    main_process = jax.process_index() == 0  # the one that writes metrics, summary and plots
    show_progress = cfg.progress and main_process
    checkpoints = RunCheckpoints(cfg.output_dir, keep_last=cfg.checkpoint.keep_last, keep_best=cfg.checkpoint.keep_best)
    config_changes = resume_check(cfg, checkpoints)
    if cfg.resume and (summary := completed_summary(cfg, checkpoints, total_steps(cfg, make_recipe(cfg.method, cfg.gate, cfg.critic.kind)),
                                                    main_process)) is not None:
        return summary
    if main_process and not cfg.resume:  # a resume writes it once its checkpoint is restored, with its changes recorded
        save_run_config(cfg, cfg.output_dir)
    start = starting_point(cfg, mesh, stop, checkpoints, config_changes, show_progress)
    compiling = first_call_notices(show_progress)
    parts, model_config, state, meta = start.parts, start.model_config, start.state, start.meta
    steps = jit_update_steps(mesh, model_config=model_config, temperature=cfg.rollout.temperature, actor=state["actor"],
                             actor_opt=state["actor_opt"], actor_tx=start.actor_tx, critic=state["critic"], critic_opt=state["critic_opt"],
                             critic_tx=start.critic_tx, critic_module=parts.critic_module, critic_kind=parts.recipe.critic,
                             actor_loss=actor_loss_of(cfg))
    batch_shardings = minibatch_shardings(mesh, with_routing=parts.recipe.critic == "tac")
    # The sampler's weights move into its own layout once per step (rollout.mesh; comppo_jax.train.decode_layout).
    decode = decode_layout.for_run(cfg, mesh, model_config, state["actor"], rollout_devices)
    logging.info("decode layout: %s", decode_layout.describe(decode))
    reference = (lambda: start.offload.fetch(start.reference)) if kl_term(cfg) else (lambda: None)

    # The mesh is the trace-time context of every sharded call, so Pallas kernels run per shard.
    with (jax.set_mesh(mesh), VerifierPool(cfg.reward.workers, cfg.reward.timeout_s, across_processes=True) as pool,
          checkpoints.completed_on_error()):
        rollout = RolloutStage(cfg, mesh, model_config, start.tokenizer, start.problems, parts, decode, reference,
                               controller.reward_schedule(cfg.reward, cfg.rollout.max_new_tokens), pool, prompt_position=meta["prompts"],
                               stop=stop, compiling=compiling, show_progress=show_progress)
        rollouts = RolloutQueue(rollout, cfg.rollout.staleness, total_steps(cfg, parts.recipe), state["rng"], start.snapshot)
        rollouts.restore(meta.get("in_flight", []), start.behaviour)
        learner = Learner(cfg, model_config, parts, steps, batch_shardings, start.offload, meta, compiling)
        recorder = Recorder(cfg, checkpoints, meta, main_process=main_process)
        return schedule(cfg, stop, state, rollouts, learner, recorder, show_progress, compiling)


def schedule(cfg, stop: StopSignals, state: dict, rollouts: RolloutQueue, learner: Learner, recorder: Recorder, show_progress: bool,
             compiling) -> dict:
    """The run as a schedule of its stages: each step the rollout stage hands over a batch
    generated, rewarded and scored by the policy after update max(0, step - 1 - staleness) (and
    starts the later ones), the learner assigns credit and updates, the recorder logs and
    checkpoints; a dev evaluation before the first step and after the last."""
    meta, last_step, rollout = recorder.meta, recorder.last_step, rollouts.stage
    if "warm_start_dev_accuracy" not in meta:
        compiling("the dev evaluation")
        meta["warm_start_dev_accuracy"] = rollout.evaluate(state["actor"], stoppable=True)
    # Steps count from 1 (comppo_jax.train.outputs): checkpoint N holds the state after step N.
    first_step = meta["step"] + 1  # its stages compile: a stop there ends the run at once, as nothing of it is saved
    progress = tqdm.trange(first_step, last_step + 1, desc=cfg.method, disable=not show_progress)
    for step in progress:
        recorder.checkpoints.confirm_saves()  # a failed async save stops the run here, in one line naming it
        started = time.time()
        experience = rollouts.take(step, state["actor"], first=step == first_step)
        updating = time.time()
        state, learned = learner.update(state, experience, step, rollouts.key(step))
        metrics = recorder.step_metrics(step, experience, learned)
        recorder.timeline(metrics, experience, (started, updating), (updating, time.time()))
        if recorder.evaluates(step):
            metrics["dev_accuracy"] = rollout.evaluate(state["actor"], stoppable=False)
        learner.control(metrics, learned)
        recorder.record(step, metrics, experience, learned, skipped=learner.skipped, phase=learner.phase, started=started)
        learner.skipped.stop_if_exhausted(step, learned.nonfinite)
        progress.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{metrics.get('kl_loss', 0.0):.4f}",
                             gate=f"{metrics.get('gate/mean', 0.0):.2f}", phase=metrics["phase"], dev=metrics.get("dev_accuracy", ""))
        stopping = stop.requested() and step < last_step  # every process reads it at the same step
        in_flight, in_flight_meta = rollouts.saved(state["actor"])
        recorder.checkpoint(step, {**state, **in_flight}, metrics, {"prompts": rollout.prompts.position, **learner.meta(), **in_flight_meta},
                            stopping=stopping)
        if stopping:
            return recorder.stopped(step)
    final_accuracy = rollout.evaluate(state["actor"], stoppable=True)  # after the last checkpoint: a resume redoes only this
    return recorder.finish(final_accuracy, len(rollout.dev_problems), learner.skipped)


class StartingPoint(NamedTuple):
    """What a run starts its stages from: a new run's initial state or a resumed run's restored one."""

    model_config: Any
    tokenizer: Any
    problems: tuple[list, list]  # (train, dev)
    parts: RunParts
    state: dict  # actor, actor_opt, critic, critic_opt, rng: on the training mesh
    meta: dict  # recorder.initial_meta()'s fields, as restored
    reference: Any  # the frozen reference policy (parked in host memory with train.offload_idle)
    snapshot: Any  # actor -> a fresh compute-dtype copy on the training mesh (the generating policy of a batch started ahead)
    behaviour: list  # a resumed run's policies of the batches in flight (rollout.staleness), else []
    actor_tx: Any
    critic_tx: Any
    offload: Offload


def starting_point(cfg, mesh, stop: StopSignals, checkpoints: RunCheckpoints, config_changes: list[dict],
                   show_progress: bool) -> StartingPoint:
    """Loads the data and the policy, runs (or reads back) the warm start, and builds the state: a
    new run's, or a resumed run's from its checkpoint (config.json rewritten with its changes)."""
    main_process = jax.process_index() == 0
    rng = jax.random.PRNGKey(cfg.seed)
    policy_rng, critic_rng, rng = jax.random.split(rng, 3)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)  # "" and no path: the character tokenizer
    train_problems, dev_problems = load_encodable_problems(cfg, tokenizer)
    model_config, actor = load_policy(cfg.model, policy_rng)
    meta = initial_meta()
    # The warm start is kept (in the run directory unless cache_dir says otherwise) the moment it ends.
    run_warm_start = lambda: cached_warm_start(
        cfg.warm_start.cache_dir or cfg.output_dir, warm_start_key(cfg), actor,
        lambda: warm_start(actor, model_config, tokenizer, train_problems, steps=cfg.warm_start.steps, batch_size=cfg.warm_start.batch_size,
                           learning_rate=cfg.warm_start.learning_rate, seed=cfg.seed, answer_noise=cfg.warm_start.answer_noise,
                           progress=show_progress, check_stop=stop.check))
    # The reference is frozen in the compute dtype; the actor trains in the master dtype.
    frozen = lambda params: jax.tree.map(lambda p: jnp.array(p, dtype=model_config.dtype, copy=True), params)
    if cfg.warm_start.steps and cfg.resume:
        reference = restore_reference(checkpoints, mesh, actor, lambda: frozen(run_warm_start()[0]))
    elif cfg.warm_start.steps:
        actor, warm_start_loss = run_warm_start()
        meta["warm_start_loss"] = float(warm_start_loss)
        reference = frozen(actor)
    else:
        reference = frozen(actor)
    actor = cast_params(actor, cfg.train.master_dtype)
    parts = run_parts(cfg, model_config)
    critic = init_critic(parts, model_config, critic_rng)
    actor_tx, critic_tx = adamw(cfg.train.actor_lr), adamw(cfg.train.critic_lr)
    state = {"actor": actor, "actor_opt": actor_tx.init(actor), "critic": critic,
             "critic_opt": None if critic is None else critic_tx.init(critic), "rng": rng}
    state = sharding.put(state, sharding.tree_shardings(mesh, state))
    compute = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, model_config.dtype), state["actor"])
    snapshot = jax.jit(lambda actor: cast_params(actor, model_config.dtype), out_shardings=sharding.tree_shardings(mesh, compute))
    behaviour = []
    if cfg.resume:  # into the mesh's shardings: every process reads its own shards
        in_flight = {"behaviour": [snapshot(state["actor"])] * cfg.rollout.staleness} if cfg.rollout.staleness else {}
        state, meta = restore_for_resume(cfg, checkpoints, {**state, **in_flight})
        behaviour = state.pop("behaviour", [])
        if main_process:
            print(f"resuming from step {meta['step']} of {total_steps(cfg, parts.recipe)} ({checkpoints.steps_directory}/{meta['step']})",
                  flush=True)
            save_run_config(cfg, cfg.output_dir)
            run_dir.record_changes(cfg.output_dir, meta["step"], config_changes)
    reference = sharding.put(reference, sharding.tree_shardings(mesh, reference))
    if cfg.warm_start.steps and not cfg.resume:  # saved once it is a global array (every process writes its shards)
        checkpoints.save_reference(reference)
    offload = Offload.of(cfg.train.offload_idle)
    reference, state["actor_opt"] = offload.park(reference), offload.park(state["actor_opt"])
    return StartingPoint(model_config, tokenizer, (train_problems, dev_problems), parts, state, meta, reference, snapshot, behaviour,
                         actor_tx, critic_tx, offload)
