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
   the phase controller's knobs; the actor waits during the critic warm-up;
6. the controller reads this step's metrics; metrics go to JSONL.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from comppo_jax.credit import clip_advantages, comp_gae, gae, grpo_advantages, load_position_schedule, masked_mean, whiten_advantages
from comppo_jax.critic import critic_from_config, fused_hidden_layers, init_standard_value_head
from comppo_jax.data.datasets import load_dapo_math
from comppo_jax.data.rewards import RewardCoefficients, VerifierPool, score_responses, terminal_reward_tokens
from comppo_jax.data.synthetic import chained_arithmetic
from comppo_jax.data.tokenizers import load_tokenizer
from comppo_jax.eval import encode_prompts, greedy_accuracy
from comppo_jax.eval.accuracy import decode_responses
from comppo_jax.models import load_policy
from comppo_jax.rollout import generate, score_rollout
from comppo_jax.train import controller
from comppo_jax.train.methods import control_gate, recipe as make_recipe, spread_over_sequence
from comppo_jax.train.update import Minibatch, actor_step, adamw, critic_step, critic_values
from comppo_jax.train.warm_start import warm_start


def load_problems(data, seed: int):
    """(train, dev) problems for the config's `data` section."""
    if data.kind == "synthetic":
        problems = chained_arithmetic(data.train_size + data.dev_size, seed=seed, min_steps=data.min_steps, max_steps=data.max_steps)
        return problems[: data.train_size], problems[data.train_size :]
    if data.kind == "dapo_math":
        return load_dapo_math(data.path, dev_size=data.dev_size, seed=seed)
    raise ValueError(f"config.data.kind={data.kind!r}; expected 'synthetic' or 'dapo_math'")


class PromptIterator:
    """Deterministic epochs of shuffled prompts; `position` (epoch, index) is checkpointable."""

    def __init__(self, count: int, batch_size: int, seed: int, position=(0, 0)):
        self.count, self.batch_size, self.seed = count, batch_size, seed
        self.epoch, self.index = position

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


def check_paths(cfg) -> None:
    """Fails before any work when a required local path is missing (nothing is downloaded)."""
    if cfg.model.get("path_required") and not cfg.model.path:
        raise ValueError("config.model.path is required for this preset: pass --config.model.path=/path/to/hf_checkpoint "
                         "(a local directory with config.json, *.safetensors and the tokenizer); nothing is downloaded")
    if cfg.model.path and not os.path.isdir(cfg.model.path):
        raise FileNotFoundError(f"config.model.path={cfg.model.path} does not exist; expected a local HF checkpoint directory")
    if cfg.data.kind != "synthetic" and not os.path.isfile(cfg.data.path):
        raise FileNotFoundError(f"config.data.path={cfg.data.path!r} does not exist; expected a local DAPO-Math-17K .parquet or .jsonl")


def train(cfg) -> dict:
    """Runs `cfg.steps` steps; returns the summary (warm-start and final dev accuracy, ...)."""
    check_paths(cfg)
    rng = jax.random.PRNGKey(cfg.seed)
    policy_rng, critic_rng, rng = jax.random.split(rng, 3)
    os.makedirs(cfg.output_dir, exist_ok=True)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)  # "" and no path: the character tokenizer
    train_problems, dev_problems = load_problems(cfg.data, cfg.seed)
    model_config, actor = load_policy(cfg.model, policy_rng)
    if cfg.warm_start.steps:
        actor, sft_loss = warm_start(actor, model_config, tokenizer, train_problems, steps=cfg.warm_start.steps,
                                     batch_size=cfg.warm_start.batch_size, learning_rate=cfg.warm_start.learning_rate, seed=cfg.seed,
                                     answer_noise=cfg.warm_start.answer_noise)
    reference = actor  # frozen: jax arrays are immutable, and the actor is rebound, never mutated
    recipe = make_recipe(cfg.method, cfg.gate, cfg.critic.kind)
    position_schedule = load_position_schedule(cfg.position_schedule) if cfg.gate == "position" and cfg.method == "comppo" else None
    n = model_config.num_layers
    hidden_layers = {"tac": fused_hidden_layers(n, cfg.critic.fused_layers), "standard": (n,), "none": ()}[recipe.critic]
    top_k = cfg.critic.top_k if recipe.critic == "tac" else None
    critic_module = critic_from_config(cfg.critic) if recipe.critic == "tac" else None
    critic = init_standard_value_head(model_config.hidden_size) if recipe.critic == "standard" else None
    actor_tx, critic_tx = adamw(cfg.train.actor_lr), adamw(cfg.train.critic_lr)
    actor_opt = actor_tx.init(actor)
    critic_opt = None if critic is None else critic_tx.init(critic)
    control_config = controller.ControllerConfig(**cfg.controller.to_dict())
    control_state = controller.initial_state()
    schedule = controller.RewardSchedule()
    prompts = PromptIterator(len(train_problems), cfg.rollout.prompts_per_step, cfg.seed)
    group = cfg.rollout.samples_per_prompt
    eos = (tokenizer.eos_token_id,)
    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    evaluate = lambda params, pool: greedy_accuracy(params, model_config, tokenizer, dev_problems, pool, max_new_tokens=cfg.rollout.max_new_tokens)

    with VerifierPool(cfg.reward.workers, cfg.reward.timeout_s) as pool, open(metrics_path, "w") as log:
        warm_accuracy = evaluate(actor, pool)
        progress = tqdm.trange(cfg.steps, desc=f"{cfg.method}", disable=not cfg.progress)
        for step in progress:
            started = time.time()
            knobs = controller.knobs(control_state, step, control_config)
            step_rng = jax.random.fold_in(rng, step + 1)

            # 1. sample
            chosen = [train_problems[i] for i in prompts.next()]
            prompt_tokens, prompt_mask = encode_prompts(tokenizer, chosen)
            generation = generate(actor, model_config, prompt_tokens, prompt_mask, step_rng, max_new_tokens=cfg.rollout.max_new_tokens,
                                  temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, num_samples=group,
                                  eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
            # 2. score (behaviour and reference policies, detached)
            rollout = score_rollout(actor, reference, model_config, generation, window=cfg.rollout.window,
                                    temperature=cfg.rollout.temperature, hidden_layers=hidden_layers, top_k=top_k,
                                    **cfg.gate_envelope.to_dict())
            # 3. reward
            format_coef, length_coef = schedule.at(step)
            lengths = np.asarray(generation.response_mask).sum(axis=1)
            texts = decode_responses(tokenizer, generation)
            rewards, _, reward_metrics = score_responses(
                texts, [p.answer for p in chosen for _ in range(group)], lengths, pool, RewardCoefficients(format_coef, length_coef))
            mask = rollout.response_mask
            reward_tokens = jnp.asarray(terminal_reward_tokens(rewards, mask))

            # 4. credit
            kappa = control_gate(recipe, rollout.kappa, mask, jax.random.fold_in(step_rng, 1), position_schedule)
            batch = Minibatch(
                generation.tokens, generation.attention_mask, generation.prompt_lengths, generation.response_tokens, mask,
                rollout.log_probs, rollout.ref_log_probs, jnp.zeros(mask.shape), jnp.zeros(mask.shape), jnp.zeros(mask.shape),
                spread_over_sequence(kappa, generation.prompt_lengths, generation.tokens.shape[1]), rollout.hidden_states, rollout.routing,
            )
            if recipe.critic == "tac" and critic is None:  # TAC's parameter shapes follow the first rollout
                critic = critic_module.init(critic_rng, batch.hidden_states, batch.routing, batch.kappa_sequence)["params"]
                critic_opt = critic_tx.init(critic)
            if recipe.estimator == "grpo":
                advantages = grpo_advantages(jnp.asarray(rewards), group, mask)
                values = returns = jnp.zeros(mask.shape)
            else:
                values = critic_values(critic, critic_module, recipe.critic, batch)
                if recipe.estimator == "gae":
                    advantages, returns = gae(reward_tokens, values, mask, gamma=1.0, lam=cfg.train.lam)
                else:
                    advantages, returns = comp_gae(reward_tokens, values, kappa, mask, cfg.train.lam)
                advantages = whiten_advantages(advantages, mask)
            advantages = clip_advantages(advantages, knobs["advantage_clip"])
            batch = batch._replace(advantages=advantages, returns=returns, old_values=values)

            # 5. update: E epochs of shuffled minibatches
            kl_coef = cfg.train.kl_coef_grpo if recipe.estimator == "grpo" else cfg.train.kl_coef
            actor_hyper = dict(learning_rate=cfg.train.actor_lr * knobs["actor_lr_multiplier"], clip=knobs["clip"],
                               kl_coef=kl_coef * knobs["kl_multiplier"], grad_clip=knobs["actor_grad_clip"])
            critic_hyper = dict(learning_rate=cfg.train.critic_lr * knobs["critic_lr_multiplier"], value_clip=knobs["value_clip"],
                                grad_clip=knobs["critic_grad_clip"])
            update_actor = step >= cfg.train.critic_warmup_steps or critic is None
            update_metrics = []
            rows = mask.shape[0]
            for epoch in range(int(knobs["actor_epochs"])):
                order = np.random.default_rng([cfg.seed, step, epoch]).permutation(rows)
                for start in range(0, rows, cfg.train.minibatch_size):
                    minibatch = take_rows(batch, order[start : start + cfg.train.minibatch_size])
                    out = {}
                    if update_actor:
                        actor, actor_opt, out = actor_step(actor, actor_opt, minibatch, actor_hyper, config=model_config,
                                                           tx=actor_tx, temperature=cfg.rollout.temperature)
                    if critic is not None:
                        critic, critic_opt, critic_out = critic_step(critic, critic_opt, minibatch, critic_hyper,
                                                                     critic_module=critic_module, kind=recipe.critic, tx=critic_tx)
                        out = {**out, **critic_out}
                    update_metrics.append({k: float(v) for k, v in out.items()})

            # 6. control and log
            metrics = {k: float(np.mean([m[k] for m in update_metrics])) for k in update_metrics[0]} if update_metrics else {}
            metrics.update(reward_metrics)
            metrics["response_clip_ratio"] = float(np.mean(lengths >= cfg.rollout.max_new_tokens))
            metrics["response_length"] = float(lengths.mean())
            metrics["gate_mean"] = float(masked_mean(kappa, mask))
            if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0:
                metrics["dev_accuracy"] = evaluate(actor, pool)
            if update_actor:
                control_state = controller.update(control_state, metrics, control_config)
            metrics.update(step=step, phase=controller.PHASES[int(control_state["phase"])], seconds=time.time() - started,
                           sample={"prompt": chosen[0].prompt, "response": texts[0], "reward": float(rewards[0])})
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            progress.set_postfix(reward=f"{metrics['reward/mean']:.2f}", phase=metrics["phase"], dev=metrics.get("dev_accuracy", ""))

        final_accuracy = evaluate(actor, pool)
    summary = {"method": cfg.method, "warm_start_dev_accuracy": warm_accuracy, "final_dev_accuracy": final_accuracy,
               "steps": cfg.steps, "dev_problems": len(dev_problems)}
    if cfg.warm_start.steps:
        summary["warm_start_loss"] = sft_loss
    with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
