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

import functools

import jax
import numpy as np

from comppo_jax import sharding
from comppo_jax.data.rewards import Verdict, VerifierPool
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.eval.restore import actor_target, eval_meshes, run_base, with_run_base
from comppo_jax.models import init_params, lora, model_config
from comppo_jax.models.lora import LoraConfig
from comppo_jax.rollout import encode_prompts, engine_options, generate, score_rollout
from comppo_jax.train.checkpoint import RunCheckpoints
from comppo_jax.train.controller import reward_schedule
from comppo_jax.train.diagnostics import critic_diagnostics, gate_statistics
from comppo_jax.train.learner import credit
from comppo_jax.train.methods import init_critic, run_parts, schedule_step, scoring_options
from comppo_jax.train.rollout_stage import load_problems
from comppo_jax.train.sampling import reward_generation
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
    parts = run_parts(cfg, policy_config)
    targets = {"actor": actor_target(mesh, cfg, policy_config)}
    if parts.recipe.critic != "none":
        key = jax.random.PRNGKey(0)  # shapes only: abstract_sharded computes nothing
        targets["critic"] = sharding.abstract_sharded(
            mesh,
            lambda: init_critic(
                parts, policy_config, key, policy=init_params(policy_config, key), master_dtype=cfg.train.master_dtype
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
            critic_values, critic_module=parts.critic_module, kind=parts.recipe.critic, model_config=policy_config
        )
    )
    batch_shardings = minibatch_shardings(
        mesh, with_routing=parts.recipe.critic == "tac", hidden_size=policy_config.hidden_size
    )
    coefficients = reward_schedule(cfg.reward, cfg.rollout.max_new_tokens).at(
        schedule_step(cfg, parts.recipe, step + 1)
    )  # as the step after checkpoint `step` reads it
    critic = restored.get("critic")
    own, shared = (
        {"kappa": [], "mask": [], "correct": []},
        {"values": [], "returns": [], "rewards": [], "kappa": [], "mask": []},
    )
    with jax.set_mesh(mesh), VerifierPool(cfg.reward.workers, cfg.reward.timeout_s, across_processes=True) as pool:
        for start in range(0, len(dev), cfg.rollout.prompts_per_step):
            chunk = dev[start : start + cfg.rollout.prompts_per_step]
            tokens, mask = encode_prompts(tokenizer, chunk)

            def score(sampler, key):
                """`sampler`'s responses to this chunk, scored by the checkpoint's actor, gate control, critic and
                estimator."""
                generation = generate(
                    sampler,
                    policy_config,
                    tokens,
                    mask,
                    key,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature,
                    top_p=cfg.rollout.top_p,
                    num_samples=group,
                    eos_token_ids=(tokenizer.eos_token_id,),
                    pad_token_id=tokenizer.pad_token_id,
                    **engine_options(cfg.rollout),
                )
                sampled = reward_generation(tokenizer, pool, generation, chunk, group, coefficients)
                rollout = score_rollout(policy, reference, policy_config, generation, **scoring_options(cfg, parts))
                return credit(
                    cfg,
                    parts,
                    values_fn,
                    critic,
                    rollout,
                    sampled,
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
