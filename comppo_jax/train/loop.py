"""The train loop, top to bottom (paper algorithm 1):

    sample -> score -> reward -> credit -> update (E epochs of minibatches) -> control -> log

`train(cfg)` runs a whole job from an ml_collections config (see configs/tiny.py). Each step:
1. sample `samples_per_prompt` responses for `prompts_per_step` prompts (KV-cache sampler);
2. score them with the behaviour policy (log-probs, H -> c -> kappa, critic features) and the
   frozen reference policy (log-probs);
3. reward: verify answers (math-verify in killable workers) with the scheduled shaping;
4. credit: the method's gate control, critic values and estimator (comppo_jax.train.methods),
   then whitened, clipped advantages;
5. update: actor clipped PPO + KL and critic clipped value regression over minibatches, with
   the phase controller's knobs; the actor waits during the critic warm-up (extra steps on top
   of `steps` unless train.critic_warmup_counts_toward_steps);
6. the controller reads this step's metrics; metrics go to JSONL and TensorBoard; every
   `checkpoint.every` steps, at every dev evaluation (so keep_best keeps the best evaluated
   policy) and at the end, an async Orbax checkpoint is started.
At the start: the run directory's lock and config.json (the whole config;
comppo_jax.train.outputs.load_run_config reads it; a resume compares against it first,
comppo_jax.train.run_dir).
At the end: summary.json, curves.png and gate_profile.json (the run's mean gate per position bin).

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
import numpy as np
import tqdm
from absl import logging

from comppo_jax import sharding
from comppo_jax.credit import (clip_advantages, comp_gae, gae, grpo_advantages, load_position_schedule, masked_mean, position_bin_totals,
                               save_position_schedule, schedule_from_totals, whiten_advantages)
from comppo_jax.credit.schedule import DEFAULT_BINS
from comppo_jax.critic import critic_from_config, fused_hidden_layers, init_standard_value_head, init_tac
from comppo_jax.data.datasets import encodable_problems, load_dapo_math
from comppo_jax.data.rewards import Verdict, VerifierPool
from comppo_jax.data.synthetic import chained_arithmetic
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.models import CheckpointError, ConfigError, load_policy
from comppo_jax.rollout import encode_prompts, engine_options, generate, greedy_accuracy, policy_gate, score_rollout
from comppo_jax.train import controller, decode_layout, run_dir
from comppo_jax.train.checkpoint import RunCheckpoints, committed_steps
from comppo_jax.train.diagnostics import critic_diagnostics, gate_statistics
from comppo_jax.train.guards import RunStopped, SkippedUpdates, StopSignals, nonfinite_credit
from comppo_jax.train.methods import (Recipe, actor_loss_of, behaviour_pass, control_gate, kl_coefficient, kl_term,
                                      recipe as make_recipe, spread_over_sequence)
from comppo_jax.train.outputs import CONFIG_FILE, METRICS_FILE, MetricsWriter, load_run_config, plot_run, save_run_config
from comppo_jax.train.sampling import Sampled, dynamic_sampling, reward_generation
from comppo_jax.train.update import Minibatch, adamw, cast_params, jit_update_steps, minibatch_shardings
from comppo_jax.train.validation import validate_config
from comppo_jax.train.warm_start import cached_warm_start, warm_start


# The rollouts' own gates averaged per bin of t/T over the whole run (a comppo_jax.credit position
# schedule): the position-only control of a later run reads it (config.position_schedule).
GATE_PROFILE_FILE = "gate_profile.json"


def load_problems(data, seed: int):
    """(train, dev) problems for the config's `data` section."""
    if data.kind == "synthetic":
        problems = chained_arithmetic(data.train_size + data.dev_size, seed=seed, min_steps=data.min_steps,
                                      max_steps=data.max_steps, operations=data.operations)
        return problems[: data.train_size], problems[data.train_size :]
    if data.kind == "dapo_math":
        return load_dapo_math(data.path, dev_size=data.dev_size, seed=seed)
    raise ValueError(f"config.data.kind={data.kind!r}; expected 'synthetic' or 'dapo_math'")


class PromptIterator:
    """Deterministic epochs of shuffled prompts; `position` (epoch, index) is checkpointable."""

    def __init__(self, count: int, batch_size: int, seed: int, position=(0, 0)):
        self.count, self.batch_size, self.seed = count, batch_size, seed
        self.epoch, self.index = position

    @property
    def position(self) -> list[int]:
        return [self.epoch, self.index]

    def next(self) -> list[int]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
        if self.index + self.batch_size > self.count:
            self.epoch, self.index = self.epoch + 1, 0
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
        chosen = order[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return [int(i) for i in chosen]


def take_rows(batch: Minibatch, rows) -> Minibatch:
    """The minibatch of `rows` (hidden states carry the batch on axis 1)."""
    pick = lambda x: None if x is None else x[rows]
    return batch._replace(
        **{name: pick(getattr(batch, name)) for name in batch._fields if name not in ("hidden_states", "routing")},
        hidden_states=batch.hidden_states[:, rows],
        routing=None if batch.routing is None else jax.tree.map(lambda x: x[rows], batch.routing),
    )


def check_batch(cfg, mesh) -> None:
    """Fails before any work on batch sizes the mesh cannot split (validate_config checks the rest)."""
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    multiple = sharding.batch_size_multiple(mesh)
    for name, size in (("train.minibatch_size", cfg.train.minibatch_size), ("rollout.prompts_per_step * samples_per_prompt", rows)):
        if size % multiple:
            raise ConfigError(f"config.{name}={size} must be a multiple of mesh data x fsdp = {multiple}; change it or config.mesh")


class RunParts(NamedTuple):
    """What a config fixes about scoring and credit: the recipe, the critic's features and module."""

    recipe: Recipe
    hidden_layers: tuple[int, ...]  # HF hidden states the critic reads
    top_k: int | None  # TAC routing width (None: no routing)
    critic_module: Any  # the TAC module, or None
    position_schedule: Any  # the position-only control's schedule, or None


def run_parts(cfg, model_config) -> RunParts:
    recipe = make_recipe(cfg.method, cfg.gate, cfg.critic.kind)
    n = model_config.num_layers
    hidden_layers = {"tac": fused_hidden_layers(n, cfg.critic.fused_layers), "standard": (n,), "none": ()}[recipe.critic]
    position_schedule = load_position_schedule(cfg.position_schedule) if recipe.gate == "position" else None
    return RunParts(recipe, hidden_layers, cfg.critic.top_k if recipe.critic == "tac" else None,
                    critic_from_config(cfg.critic) if recipe.critic == "tac" else None, position_schedule)


def gate_options(cfg) -> dict:
    """The gate's keywords for a config (`policy_gate`'s, and part of `score_rollout`'s)."""
    return dict(window=cfg.rollout.window, gate_statistic=cfg.gate_statistic, sink_tokens=cfg.sink_tokens, **cfg.gate_envelope.to_dict())


def scoring_options(cfg, parts: RunParts) -> dict:
    """`score_rollout`'s keywords for a config (all but the kernel backend)."""
    return dict(temperature=cfg.rollout.temperature, hidden_layers=parts.hidden_layers, top_k=parts.top_k,
                old_log_probs=cfg.rollout.old_log_probs, behaviour_pass=behaviour_pass(parts.recipe, cfg.rollout.old_log_probs),
                **gate_options(cfg))


def critic_warmup(cfg, recipe: Recipe) -> int:
    """Critic-only steps at the start of the run (none without a critic)."""
    return cfg.train.critic_warmup_steps if recipe.critic != "none" else 0


def total_steps(cfg, recipe: Recipe) -> int:
    """The run's loop steps: `steps` actor updates after the critic warm-up, or, with
    train.critic_warmup_counts_toward_steps (the paper's literal reading), `steps` in all."""
    return cfg.steps if cfg.train.critic_warmup_counts_toward_steps else cfg.steps + critic_warmup(cfg, recipe)


def prepended_warmup(cfg, recipe: Recipe) -> int:
    """Warm-up steps added on top of `steps`: the reward schedule, the knobs' drift and the dev
    evaluations count from the first actor update after them, as in a run without a critic."""
    return total_steps(cfg, recipe) - cfg.steps


def schedule_step(cfg, recipe: Recipe, step: int) -> int:
    """What the reward schedule and the knobs' drift read at step `step` (1-based): the steps
    after the prepended critic warm-up that came before it."""
    return max(step - 1 - prepended_warmup(cfg, recipe), 0)


def init_critic(parts: RunParts, model_config, rng):
    """Fresh critic params for the recipe (None without a critic)."""
    if parts.recipe.critic == "tac":
        return init_tac(parts.critic_module, rng, len(parts.hidden_layers), model_config.hidden_size, parts.top_k)
    return init_standard_value_head(model_config.hidden_size) if parts.recipe.critic == "standard" else None


class Scored(NamedTuple):
    """A sampled batch after score -> reward -> credit (advantages whitened, not yet clipped)."""

    batch: Minibatch
    rollout: Any  # comppo_jax.rollout.Rollout without the critic's features (kappa: the policy's own gate)
    sampled: Sampled  # the generation, its problems, texts, rewards and verdicts
    kappa: jax.Array  # [B, T] the gate the estimator and critic read (after the control)


def estimate_credit(cfg, recipe: Recipe, rewards, reward_tokens, values, kappa, mask):
    """(advantages, returns) [B, T] of the recipe's estimator: group-relative for GRPO (Dr.GRPO
    without the std with train.group_std_normalization=False), else GAE / Comp-GAE on `values`,
    whitened."""
    if recipe.estimator == "grpo":
        advantages = grpo_advantages(jnp.asarray(rewards), cfg.rollout.samples_per_prompt, mask,
                                     normalize_std=cfg.train.group_std_normalization)
        return advantages, jnp.zeros(mask.shape)
    if recipe.estimator == "gae":
        advantages, returns = gae(jnp.asarray(reward_tokens), values, mask, gamma=1.0, lam=cfg.train.lam)
    else:
        advantages, returns = comp_gae(jnp.asarray(reward_tokens), values, kappa, mask, cfg.train.lam)
    return whiten_advantages(advantages, mask), returns


def score_and_credit(cfg, parts: RunParts, model_config, values_fn, critic, policy, reference, sampled: Sampled, rng,
                     batch_shardings) -> Scored:
    """Steps 2 and 4 of a train step for one rewarded generation (also the held-out diagnostics' path)."""
    generation = sampled.generation
    # 2. score (behaviour and reference policies, detached)
    rollout = score_rollout(policy, reference, model_config, generation, **scoring_options(cfg, parts))
    mask = rollout.response_mask
    # 4. credit
    kappa = control_gate(parts.recipe, rollout.kappa, mask, rng, parts.position_schedule, fixed_value=cfg.fixed_gate)
    zeros = jnp.zeros(mask.shape)
    batch = sharding.put(Minibatch(
        generation.tokens, generation.attention_mask, generation.prompt_lengths, generation.response_tokens, mask,
        rollout.log_probs, zeros if rollout.ref_log_probs is None else rollout.ref_log_probs, zeros, zeros, zeros,
        spread_over_sequence(kappa, generation.prompt_lengths, generation.tokens.shape[1]), rollout.hidden_states, rollout.routing,
    ), batch_shardings)
    values = zeros if parts.recipe.estimator == "grpo" else values_fn(critic, batch)
    advantages, returns = estimate_credit(cfg, parts.recipe, sampled.rewards, sampled.reward_tokens, values, kappa, mask)
    batch = batch._replace(advantages=advantages, returns=returns, old_values=values)
    # The critic's features live on in `batch` only (no second copy through the update).
    rollout = rollout._replace(hidden_states=None, routing=None)
    return Scored(batch, rollout, sampled, kappa)


def refreshed_credit(cfg, parts: RunParts, model_config, actor, scored: Scored, rng, advantage_clip) -> tuple[dict, jax.Array]:
    """gate_refresh=epoch: the current actor's gate on the stored batch (H -> c -> kappa, no
    gradient), through the gate control, and Comp-GAE rerun with the stored values and rewards.
    Returns (the Minibatch fields that change: advantages (whitened, clipped), returns and
    kappa_sequence; the new kappa [B, T])."""
    batch, mask = scored.batch, scored.batch.response_mask
    own = policy_gate(cast_params(actor, model_config.dtype), model_config, batch.tokens, batch.attention_mask, batch.prompt_lengths,
                      mask, length=mask.shape[1], **gate_options(cfg))
    kappa = control_gate(parts.recipe, own, mask, rng, parts.position_schedule, fixed_value=cfg.fixed_gate)
    advantages, returns = estimate_credit(cfg, parts.recipe, scored.sampled.rewards, scored.sampled.reward_tokens, batch.old_values,
                                          kappa, mask)
    fields = dict(advantages=clip_advantages(advantages, advantage_clip), returns=returns,
                  kappa_sequence=spread_over_sequence(kappa, batch.prompt_lengths, batch.tokens.shape[1]))
    return fields, kappa


def warm_start_key(cfg) -> dict:
    """Everything the warm-started policy depends on (its cache key)."""
    settings = {k: v for k, v in cfg.warm_start.to_dict().items() if k != "cache_dir"}
    return {"model": cfg.model.to_dict(), "data": cfg.data.to_dict(), "warm_start": settings, "seed": cfg.seed}


def load_encodable_problems(cfg, tokenizer):
    """(train, dev) problems without the rows the tokenizer cannot encode (skipped and counted)."""
    train_problems, dev_problems = load_problems(cfg.data, cfg.seed)
    where = cfg.data.path or f"the {cfg.data.kind} data"
    longest_prompt = cfg.model.arch.max_position_embeddings - cfg.rollout.max_new_tokens
    return (encodable_problems(tokenizer, train_problems, f"{where} (train)", max_prompt_tokens=longest_prompt),
            encodable_problems(tokenizer, dev_problems, f"{where} (dev)", max_prompt_tokens=longest_prompt))


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


def stopped(cfg, checkpoints: RunCheckpoints, writer: MetricsWriter, step: int) -> dict:
    """Finishes a run stopped by a signal after `step`: its checkpoint is confirmed written."""
    checkpoints.close()  # waits for the save and raises if it failed
    writer.close()
    return {"stopped_at_step": step, "checkpoint": os.path.join(checkpoints.steps_directory, str(step))}


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
    mesh = sharding.make_mesh(cfg.mesh)
    check_batch(cfg, mesh)
    decode_layout.check_config(cfg, mesh)
    os.makedirs(cfg.output_dir, exist_ok=True)
    # One writer per run directory; from here on a SIGTERM / SIGINT stops the run cleanly.
    with run_dir.locked(cfg.output_dir), StopSignals() as stop:
        try:
            return run_training(cfg, mesh, stop)
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


def run_training(cfg, mesh, stop: StopSignals) -> dict:
    """`train` inside the run directory's lock, with the stop signals installed."""
    control_config = controller.controller_config(cfg.controller)
    schedule = controller.reward_schedule(cfg.reward, cfg.rollout.max_new_tokens)
    main_process = jax.process_index() == 0  # the one that writes metrics, summary and plots
    show_progress = cfg.progress and main_process
    checkpoints = RunCheckpoints(cfg.output_dir, keep_last=cfg.checkpoint.keep_last, keep_best=cfg.checkpoint.keep_best)
    config_changes = resume_check(cfg, checkpoints)
    last_step = total_steps(cfg, make_recipe(cfg.method, cfg.gate, cfg.critic.kind))
    if cfg.resume and (summary := completed_summary(cfg, checkpoints, last_step, main_process)) is not None:
        return summary
    if main_process and not cfg.resume:  # a resume writes it once its checkpoint is restored, with its changes recorded
        save_run_config(cfg, cfg.output_dir)
    rng = jax.random.PRNGKey(cfg.seed)
    policy_rng, critic_rng, rng = jax.random.split(rng, 3)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)  # "" and no path: the character tokenizer
    train_problems, dev_problems = load_encodable_problems(cfg, tokenizer)
    model_config, actor = load_policy(cfg.model, policy_rng)
    # gate_profile: per-bin sums of the rollouts' own kappa over t/T (the position-only control's fit).
    # step: the last step done, the number of the checkpoint that holds this meta.
    meta = {"step": 0, "prompts": [0, 0], "controller": controller.initial_state(), "skipped_updates": SkippedUpdates(0).state(),
            "gate_profile": {"sums": [0.0] * DEFAULT_BINS, "counts": [0] * DEFAULT_BINS}}
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
    if cfg.resume:  # into the mesh's shardings: every process reads its own shards
        state, meta = restore_for_resume(cfg, checkpoints, state)
        if main_process:
            print(f"resuming from step {meta['step']} of {last_step} ({checkpoints.steps_directory}/{meta['step']})", flush=True)
            save_run_config(cfg, cfg.output_dir)
            run_dir.record_changes(cfg.output_dir, meta["step"], config_changes)
    reference = sharding.put(reference, sharding.tree_shardings(mesh, reference))
    if cfg.warm_start.steps and not cfg.resume:  # saved once it is a global array (every process writes its shards)
        checkpoints.save_reference(reference)
    # train.offload_idle: what the next program does not read waits in host memory.
    park, fetch = ((lambda tree: sharding.to_memory(tree, "pinned_host"), lambda tree: sharding.to_memory(tree, "device"))
                   if cfg.train.offload_idle else (lambda tree: tree, lambda tree: tree))
    reference, state["actor_opt"] = park(reference), park(state["actor_opt"])
    steps = jit_update_steps(mesh, model_config=model_config, temperature=cfg.rollout.temperature, actor=state["actor"],
                             actor_opt=state["actor_opt"], actor_tx=actor_tx, critic=state["critic"], critic_opt=state["critic_opt"],
                             critic_tx=critic_tx, critic_module=parts.critic_module, critic_kind=parts.recipe.critic,
                             actor_loss=actor_loss_of(cfg))
    batch_shardings = minibatch_shardings(mesh, with_routing=parts.recipe.critic == "tac")
    control_state = meta["controller"]
    warmup, prepended = critic_warmup(cfg, parts.recipe), prepended_warmup(cfg, parts.recipe)
    prompts = PromptIterator(len(train_problems), cfg.rollout.prompts_per_step, cfg.seed, position=meta["prompts"])
    group = cfg.rollout.samples_per_prompt
    eos = (tokenizer.eos_token_id,)
    compiling = first_call_notices(show_progress)
    # The sampler's weights move into its own layout once per step (rollout.mesh; comppo_jax.train.decode_layout).
    decode = decode_layout.for_run(cfg, mesh, model_config, state["actor"])
    logging.info("decode layout: %s", decode_layout.describe(decode))

    def evaluate(params, pool, stoppable: bool) -> float:
        """Dev accuracy; `stoppable`: a stop request ends it within one batch (RunStopped). An evaluation
        inside a step is not: its accuracy drives the controller, so the step is saved only with it
        (and a resumed run equals the straight one)."""
        with jax.set_mesh(decode.mesh):
            return greedy_accuracy(decode.reshard(params), model_config, tokenizer, dev_problems, pool,
                                   max_new_tokens=cfg.rollout.max_new_tokens, progress="dev eval" * show_progress,
                                   after_batch=(lambda: stop.check("the dev evaluation")) if stoppable else None)

    writer = MetricsWriter(cfg.output_dir, resumed_step=meta["step"], tensorboard=cfg.tensorboard, enabled=main_process)
    skipped = SkippedUpdates(cfg.train.max_skipped_updates, **meta.get("skipped_updates", {}))  # absent before the guard existed

    # The mesh is the trace-time context of every sharded call, so Pallas kernels run per shard.
    with (jax.set_mesh(mesh), VerifierPool(cfg.reward.workers, cfg.reward.timeout_s, across_processes=True) as pool,
          checkpoints.completed_on_error()):
        if "warm_start_dev_accuracy" not in meta:
            compiling("the dev evaluation")
            meta["warm_start_dev_accuracy"] = evaluate(state["actor"], pool, stoppable=True)
        # Steps count from 1 (comppo_jax.train.outputs): checkpoint N holds the state after step N.
        first_step = meta["step"] + 1  # its stages compile: a stop there ends the run at once, as nothing of it is saved
        progress = tqdm.trange(first_step, last_step + 1, desc=cfg.method, disable=not show_progress)
        for step in progress:
            checkpoints.confirm_saves()  # a failed async save stops the run here, in one line naming it
            started = time.time()
            scheduled = schedule_step(cfg, parts.recipe, step)
            knobs = controller.knobs(control_state, scheduled, control_config)
            step_rng = jax.random.fold_in(state["rng"], step)
            actor, critic = state["actor"], state["critic"]
            resharding = time.time()
            sampler = jax.block_until_ready(decode.reshard(actor))  # the compute copy in the decode layout
            reshard_seconds = time.time() - resharding

            # 1. sample, 3. reward (before scoring, so that dynamic sampling scores only the groups it keeps)
            def sample(round_index: int) -> Sampled:  # round 0: the step's batch; later: dynamic sampling's refills
                key = step_rng if round_index == 0 else jax.random.fold_in(step_rng, 1 + round_index)  # 1: the gate control's
                chosen = [train_problems[i] for i in prompts.next()]
                prompt_tokens, prompt_mask = encode_prompts(tokenizer, chosen)
                compiling("the sampler")
                with jax.set_mesh(decode.mesh):
                    generation = generate(sampler, model_config, prompt_tokens, prompt_mask, decode.replicated(key),
                                          max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                          top_p=cfg.rollout.top_p, num_samples=group, eos_token_ids=eos,
                                          pad_token_id=tokenizer.pad_token_id, **engine_options(cfg.rollout))
                generation = decode.to_training(generation, mesh)
                return reward_generation(tokenizer, pool, generation, chosen, group, schedule.at(scheduled))

            sampled = sample(0)
            if cfg.rollout.dynamic_sampling:
                sampled = dynamic_sampling(sampled, sample, group, cfg.rollout.max_refills, cfg.rollout.dynamic_sampling_filter,
                                           len(train_problems))
            if step == first_step:
                stop.check(f"step {step}'s first sampling (compiling; the step is not saved)")
            policy = cast_params(actor, model_config.dtype) if decode.resharded else sampler
            del sampler
            # 2, 4. score, credit
            compiling("the scoring pass and credit")
            gate_key = jax.random.fold_in(step_rng, 1)
            scored = score_and_credit(cfg, parts, model_config, steps.values, critic, policy,
                                      fetch(reference) if kl_term(cfg) else None, sampled, gate_key, batch_shardings)
            del policy, sampled  # the compute copy is not kept through the update (launch/plan.py counts on it)
            if step == first_step:
                stop.check(f"step {step}'s first scoring (compiling; the step is not saved)")
            host_mask = scored.sampled.host_mask
            lengths = host_mask.sum(axis=1)
            batch = scored.batch._replace(advantages=clip_advantages(scored.batch.advantages, knobs["advantage_clip"]))
            to_update = (lambda tree: jax.tree.map(sharding.to_host, tree)) if cfg.train.offload_idle else (lambda tree: tree)
            batch = to_update(batch)  # train.offload_idle: the update reads one minibatch at a time, the rest waits on the host
            state["actor_opt"] = fetch(state["actor_opt"])

            # 5. update: E epochs of shuffled minibatches
            actor_hyper = dict(learning_rate=cfg.train.actor_lr * knobs["actor_lr_multiplier"], clip=knobs["clip"],
                               kl_coef=kl_coefficient(cfg) * knobs["kl_multiplier"], grad_clip=knobs["actor_grad_clip"])
            critic_hyper = dict(learning_rate=cfg.train.critic_lr * knobs["critic_lr_multiplier"], value_clip=knobs["value_clip"],
                                grad_clip=knobs["critic_grad_clip"])
            update_actor = step > warmup
            update_metrics = []
            rows = len(lengths)
            # A non-finite reward, value, advantage or return skips the whole update.
            nonfinite = nonfinite_credit(scored.sampled.rewards, values=batch.old_values, advantages=batch.advantages, returns=batch.returns)
            gate_changes = []
            for epoch in range(0 if nonfinite else int(knobs["actor_epochs"])):
                # Epoch 0's actor is the behaviour policy (as is every epoch's during the critic warm-up): its gate is the rollout's.
                if cfg.gate_refresh == "epoch" and epoch > 0 and update_actor:
                    compiling("the gate refresh")
                    fresh, kappa = refreshed_credit(cfg, parts, model_config, state["actor"], scored, gate_key, knobs["advantage_clip"])
                    gate_changes.append(float(masked_mean(jnp.abs(kappa - scored.kappa), scored.batch.response_mask)))
                    # A non-finite refreshed credit is caught by the steps' own guards (actor_finite, critic_finite).
                    batch = batch._replace(**to_update(fresh))
                # step - 1: the shuffles of the earlier 0-based numbering, so earlier runs reproduce
                order = np.random.default_rng([cfg.seed, step - 1, epoch]).permutation(rows)
                for start in range(0, rows, cfg.train.minibatch_size):
                    minibatch = sharding.put(take_rows(batch, order[start : start + cfg.train.minibatch_size]), batch_shardings)
                    out = {}
                    if update_actor:
                        compiling("the actor update")
                        state["actor"], state["actor_opt"], out = steps.actor(state["actor"], state["actor_opt"], minibatch, actor_hyper)
                    if critic is not None:
                        compiling("the critic update")
                        state["critic"], state["critic_opt"], critic_out = steps.critic(state["critic"], state["critic_opt"], minibatch,
                                                                                        critic_hyper)
                        out = {**out, **critic_out}
                    update_metrics.append({k: float(v) for k, v in out.items()})
            state["actor_opt"] = park(state["actor_opt"])
            for name, quantity in (("actor_finite", "actor loss or gradient norm"), ("critic_finite", "critic loss or gradient norm")):
                unapplied = sum(m.pop(name, 1.0) == 0.0 for m in update_metrics)
                if unapplied:  # those minibatches' updates were skipped inside the jitted step
                    nonfinite.append(f"{quantity} ({unapplied} of {len(update_metrics)} minibatches)")
            skipped.record(nonfinite)

            # 6. control, log, checkpoint
            metrics = {k: float(np.mean([m[k] for m in update_metrics])) for k in update_metrics[0]} if update_metrics else {}
            metrics.update(scored.sampled.reward_metrics)
            if gate_changes:
                metrics["gate_refresh/mean_abs_change"] = float(np.mean(gate_changes))
            metrics["response_clip_ratio"] = float(np.mean(lengths >= cfg.rollout.max_new_tokens))
            metrics["response_length"] = float(lengths.mean())
            host = sharding.to_host
            correct = np.asarray([v is Verdict.CORRECT for v in scored.sampled.verdicts])
            if scored.rollout.kappa is not None:  # the policy's own gate, every method that ran the behaviour pass
                own_kappa = host(scored.rollout.kappa)
                metrics.update(gate_statistics(own_kappa, host_mask, correct))
                for name, totals in zip(("sums", "counts"), position_bin_totals(own_kappa, host_mask)):
                    meta["gate_profile"][name] = (np.asarray(meta["gate_profile"][name]) + totals).tolist()
            if critic is not None:
                metrics.update(critic_diagnostics(host(batch.old_values), host(batch.returns), scored.sampled.reward_tokens, host(scored.kappa),
                                                  host_mask))
            metrics["actor_updates"] = max(0, step - warmup)
            evaluated = cfg.train.eval_every and step > prepended and (step - prepended) % cfg.train.eval_every == 0
            if evaluated:
                metrics["dev_accuracy"] = evaluate(state["actor"], pool, stoppable=False)
            if update_actor and not nonfinite:
                control_state = controller.update(control_state, metrics, control_config)
            metrics["skipped_updates"] = skipped.total
            if nonfinite:
                metrics["nonfinite"] = ", ".join(nonfinite)
            metrics.update(step=step, phase=controller.PHASES[int(control_state["phase"])], seconds=time.time() - started,
                           reshard_seconds=reshard_seconds,
                           sample={"prompt": scored.sampled.problems[0].prompt, "response": scored.sampled.texts[0],
                                   "reward": float(scored.sampled.rewards[0])})
            writer.write(metrics)
            skipped.stop_if_exhausted(step, nonfinite)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.2f}", kl=f"{metrics.get('kl_loss', 0.0):.4f}",
                                 gate=f"{metrics.get('gate/mean', 0.0):.2f}", phase=metrics["phase"], dev=metrics.get("dev_accuracy", ""))
            stopping = stop.requested() and step < last_step  # every process reads it at the same step
            # Every evaluated step is saved too, so that keep_best can keep the best evaluated policy.
            if step % cfg.checkpoint.every == 0 or step == last_step or stopping or evaluated:
                meta.update(step=step, prompts=prompts.position, controller=control_state, skipped_updates=skipped.state())
                checkpoints.save(step, state, meta, metrics.get("dev_accuracy"))
            if stopping:
                return stopped(cfg, checkpoints, writer, step)

        final_accuracy = evaluate(state["actor"], pool, stoppable=True)  # after the last checkpoint: a resume redoes only this
    checkpoints.wait()
    summary = {"method": cfg.method, "warm_start_dev_accuracy": meta["warm_start_dev_accuracy"], "final_dev_accuracy": final_accuracy,
               "steps": last_step, "actor_updates": max(0, last_step - warmup), "dev_problems": len(dev_problems),
               "best_checkpoint_step": checkpoints.best_step(), "best_dev_accuracy": checkpoints.best_accuracy()}
    checkpoints.close()
    writer.close()
    if "warm_start_loss" in meta:
        summary["warm_start_loss"] = meta["warm_start_loss"]
    gated = np.sum(meta["gate_profile"]["counts"]) > 0  # no gate without the behaviour pass (rollout.old_log_probs=sampler)
    if gated:
        summary["mean_gate"] = float(np.sum(meta["gate_profile"]["sums"]) / np.sum(meta["gate_profile"]["counts"]))
    summary["skipped_updates"] = skipped.total
    if not main_process:
        return summary
    if gated:
        profile = schedule_from_totals(meta["gate_profile"]["sums"], meta["gate_profile"]["counts"],
                                       {"source": os.path.abspath(cfg.output_dir), "method": cfg.method, "steps": last_step, "seed": cfg.seed})
        save_position_schedule(profile, os.path.join(cfg.output_dir, GATE_PROFILE_FILE))
    with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if cfg.plot:
        plot_run(os.path.join(cfg.output_dir, METRICS_FILE), os.path.join(cfg.output_dir, "curves.png"),
                 title=f"{cfg.method}: dev accuracy {meta['warm_start_dev_accuracy']:.2f} -> {final_accuracy:.2f}",
                 warm_start_accuracy=meta["warm_start_dev_accuracy"])
    return summary
