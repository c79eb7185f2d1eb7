"""A run's checkpoint on held-out prompts: its realized gate and its critic (paper sections 6.3-6.4).

- Gate statistics: the checkpoint's policy samples responses to the first `problems` dev prompts;
  its own kappa_t on them (mean, median, IQR, response thirds, correct vs incorrect responses).
- Critic diagnostics on a shared held-out token sample: the *reference* policy samples those
  prompts with a fixed key, so every run with the same reference (every cell and control of a
  seed; every run at all when the reference is the HF checkpoint) is measured on the same tokens.
  The checkpoint's actor scores them (features, routing, kappa), its gate control and critic give
  kappa and V_t, and the run's own estimator gives the returns: explained variance, Spearman of V_t
  with r_t + kappa_t V_{t+1}, MAE and clamp saturation (comppo_jax.train.diagnostics).

Rewards use the reward schedule's coefficients at the checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from comppo_jax import sharding
from comppo_jax.data.rewards import Verdict, VerifierPool
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.eval.restore import actor_target, eval_meshes, run_base, with_run_base
from comppo_jax.models import init_params, lora, model_config
from comppo_jax.models.lora import LoraConfig
from comppo_jax.rollout.experience import ExperienceEnv, experience
from comppo_jax.runs.checkpoint import RunCheckpoints
from comppo_jax.train.diagnostics import critic_diagnostics, gate_statistics
from comppo_jax.train.learner import assign_credit
from comppo_jax.train.methods import init_critic
from comppo_jax.train.specs import resolve
from comppo_jax.train.start import load_problems
from comppo_jax.train.update import cast_params, critic_values, minibatch_shardings

SHARED_SAMPLE_KEY = 0  # the reference's sampling key: the same tokens for every run


def _rows(arrays):
    """Concatenates [b_i, T_i] host arrays along rows, right-padding to the widest T with zeros."""
    width = max(a.shape[1] for a in arrays)
    return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays])


def held_out_diagnostics(cfg, checkpoints: RunCheckpoints, step: str | int = "latest", problems: int = 32) -> dict:
    """Gate statistics and critic diagnostics of a run's checkpoint `step` (latest, best or N) on
    the first `problems` dev problems, `cfg.rollout.samples_per_prompt` responses each."""
    cfg = cfg.copy_and_resolve_references()
    cfg.rollout.old_log_probs = "rescore"  # the gate needs the behaviour pass, whatever the run skipped
    mesh = eval_meshes(cfg.mesh)[0]  # the training devices of a run with its own rollout devices
    policy_config = model_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    step = checkpoints.resolve_step(step)
    spec = resolve(cfg, policy_config)
    credit = spec.learner.credit
    # The first `problems` dev prompts as they are: no dynamic sampling's refills.
    rollout = spec.rollout.experience
    rollout = dataclasses.replace(rollout, rollout=dataclasses.replace(rollout.rollout, dynamic_sampling=False))
    targets = {"actor": actor_target(mesh, cfg, policy_config)}
    if credit.recipe.critic != "none":
        key = jax.random.PRNGKey(0)  # shapes only: abstract_sharded computes nothing
        targets["critic"] = sharding.abstract_sharded(
            mesh,
            lambda: init_critic(
                credit, policy_config, key, policy=init_params(policy_config, key), master_dtype=cfg.train.master_dtype
            ),
        )
    restored = checkpoints.restore_params(targets, step)
    policy = cast_params(with_run_base(cfg, checkpoints, mesh, policy_config, restored["actor"]), policy_config.dtype)
    reference = (
        lora.base(policy) if LoraConfig.of(cfg.model).enabled else run_base(cfg, checkpoints, mesh, policy_config)
    )
    dev = load_problems(cfg.data, cfg.seed)[1][:problems]
    if not dev:
        raise ValueError(
            f"{checkpoints.directory}: the config's dev split is empty; held-out diagnostics need dev problems"
        )
    group = cfg.rollout.samples_per_prompt
    values_fn = jax.jit(
        functools.partial(
            critic_values, critic_module=credit.critic_module, kind=credit.recipe.critic, model_config=policy_config
        )
    )
    batch_shardings = minibatch_shardings(
        mesh, with_routing=credit.recipe.critic == "tac", hidden_size=policy_config.hidden_size
    )
    # As the step after checkpoint `step` reads it.
    coefficients = spec.rollout.reward_schedule.at(spec.steps.schedule_step(step + 1))
    critic = restored.get("critic")
    own, shared = (
        {"kappa": [], "mask": [], "correct": []},
        {"values": [], "returns": [], "rewards": [], "kappa": [], "mask": []},
    )
    with jax.set_mesh(mesh), VerifierPool(cfg.reward.workers, cfg.reward.timeout_s, across_processes=True) as pool:
        env = ExperienceEnv(policy_config, tokenizer, pool, coefficients)
        for start in range(0, len(dev), cfg.rollout.prompts_per_step):
            chunk = dev[start : start + cfg.rollout.prompts_per_step]

            def score(sampler, key):
                """`sampler`'s responses to this chunk, scored by the checkpoint's actor, gate control, critic and
                estimator."""
                batch = experience(policy, reference, chunk, key, rollout, env, sampler=sampler)
                return assign_credit(
                    credit,
                    values_fn,
                    critic,
                    batch.rollout,
                    batch.sampled,
                    jax.random.fold_in(jax.random.PRNGKey(cfg.seed), start),
                    batch_shardings,
                )

            mine = score(policy, jax.random.fold_in(jax.random.PRNGKey(cfg.seed + 1), start))
            own["kappa"].append(sharding.to_host(mine.rollout.kappa))
            own["mask"].append(mine.sampled.host_mask)
            own["correct"].append(np.asarray([v is Verdict.CORRECT for v in mine.sampled.verdicts]))
            if critic is not None:
                theirs = score(reference, jax.random.fold_in(jax.random.PRNGKey(SHARED_SAMPLE_KEY), start))
                batch = theirs.batch
                for name, value in (("values", batch.old_values), ("returns", batch.returns), ("kappa", theirs.kappa)):
                    shared[name].append(sharding.to_host(value))
                shared["rewards"].append(theirs.sampled.reward_tokens)
                shared["mask"].append(theirs.sampled.host_mask)
    out = {"step": step, "problems": len(dev), "responses": len(dev) * group}
    out.update(gate_statistics(_rows(own["kappa"]), _rows(own["mask"]).astype(bool), np.concatenate(own["correct"])))
    if critic is not None:
        out.update(
            critic_diagnostics(
                *(_rows(shared[k]) for k in ("values", "returns", "rewards", "kappa")),
                _rows(shared["mask"]).astype(bool),
            )
        )
    return out
