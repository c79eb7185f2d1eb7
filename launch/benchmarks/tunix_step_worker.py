"""One GRPO or PPO train step with tunix's `GRPOLearner` / `PPOLearner`, driven over stdin/stdout
by a benchmark.

    /tmp/tunix_venv/bin/python tunix_step_worker.py MODEL_DIR

This runs under its own virtualenv, never the project's: tunix pins its own jax/flax, which
differ from the ones comppo_jax is built against, so the two cannot share an interpreter. For
the same reason this file imports nothing from comppo_jax; the parent talks to it in JSON lines.

MODEL_DIR is a Hugging Face Qwen3 checkpoint (config.json + *.safetensors). The model is built
from config.json field by field and loaded with tunix's own safetensors loader, in float32. That
model is the reference policy; the actor (policy being trained, which the vanilla rollout engine
also samples from) starts as a copy of it, the way tunix's GRPO CLI builds the pair. PPO's critic
is PPO as tunix runs it: a second full model, a copy of the same weights (embedding, every decoder
layer, final norm) with a zero-initialised linear value head in place of the vocabulary
projection (`ValueModel`), all of it trained.

Protocol (one JSON object per line):
  out: {"ready": true, "jax": ..., "tunix": ...}                        once the model is loaded
  in:  {"algo": "grpo"|"ppo", "prompts": [[id, ...], ...], "samples": G, "max_new_tokens": N,
        "temperature": T}
       B equal-length, unpadded prompts of token ids (PPO samples each prompt once: G must be 1;
       the parent repeats a prompt to sample it several times)
  out: {"rollout_s": ..., "scoring_s": ..., "values_s": ..., "credit_s": ..., "update_s": ...,
        "critic_update_s": ..., "total_s": ..., "rows": B * G, "response_tokens": N}
Each request runs ONE full train step through tunix's real training loop:
`<Learner>.train([{"prompts": B x L ids}])` with one batch, one global step, one mini batch
(= the whole batch), one micro batch, num_iterations 1. Inside that call tunix does
  rollout  `RLCluster.generate` (VanillaRollout -> tunix `Sampler`): G samples per prompt,
           exactly N new tokens each (EOS id -1 can never be sampled, so no row stops early);
  scoring  `RLCluster.get_ref_per_token_logps` (reference model, `common.compute_per_token_logps`);
           `RLCluster.get_old_per_token_logps`: PPO always calls it; GRPO only if
           num_iterations > 1, which it is not here (with one iteration GRPOLearner skips it and
           the loss uses stop_gradient(current logps));
  values   PPO: `RLCluster.get_values` (the critic's forward over the whole batch);
  credit   PPO: the registered GAE estimator (`algo_core.compute_gae_advantages`, jitted, on
           device), timed through a wrapper registered as "timed_gae"; GRPO's group advantages
           are host numpy inside the learner and stay in its host work;
  rewards  the reward function below (host);
  update   `RLCluster.update_actor` -> `rl.trainer.Trainer.train` -> one jitted
           `PeftTrainer._train_step` (policy loss forward, backward, AdamW update);
  critic   PPO: `RLCluster.update_critic`, the same for the value model (clipped value loss).
The timed phases are measured by wrapping those RLCluster methods on the instance (the learner
calls them through `self.rl_cluster`, so it calls the wrappers); each wrapper ends with
`jax.block_until_ready` on the phase's results (for the updates: the model's params and the
optimizer state), so the times are real. `total_s` is the wall time of the whole `train` call,
so total_s minus the phases is tunix's own host work around them (data queue/thread, repeat of
prompts, padding, rewards, GRPO's advantages, metrics buffering, `RLCluster.close()` at the end).

Reward: a cheap stand-in, i.i.d. uniform [0, 1) numbers from a fixed-seed numpy generator (so
advantages are non-zero and the policy-gradient term is live). Sampling is plain
temperature-T categorical sampling (tunix's RolloutConfig default top_p=1.0 with top_k=None
takes the `jax.random.categorical` path, no sort); T must be > 0.

tunix's configs fix the batch, prompt length, N, G and T, and the vanilla rollout's KV cache
(sized exactly L + N, as the sampler needs), so the RLCluster and learner are built for the
first request of each (algo, shape) and kept while it repeats; a new one drops them and builds
fresh ones from the loaded weights (weights and AdamW state reset). Compilation therefore lands
in the first call of each (and again on a return to an earlier one after another), so the
parent should warm up with one identical call right before the timed ones. EOF ends the worker;
any error goes to stderr, exit status 1.
"""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.rl import algo_core, function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner
from tunix.rl.rollout import base_rollout

# First: the sampler worker beside this file keeps the real stdout for the JSON lines (any stray
# print would corrupt them) and lends its model loading, tokenizer stand-in and protocol helpers.
# NO_TOKEN (-1) as EOS can never be sampled, so every row decodes to max_new_tokens.
from tunix_worker import NO_TOKEN, TokenIdTokenizer, check_request, fail, load_model, reply, run_worker

ALGOS = ("grpo", "ppo")
# Learner hyperparameters (tunix's GRPOConfig / PPOConfig defaults where they exist).
BETA = 0.04  # KL coefficient > 0, so the reference model is used
EPSILON = 0.2
NUM_ITERATIONS = 1
# AdamW as in tunix's GRPO examples (no schedule, no gradient clipping), for actor and critic.
LEARNING_RATE = 3e-6
ADAM_B1, ADAM_B2, WEIGHT_DECAY = 0.9, 0.99, 0.1
PHASES = ("rollout", "scoring", "values", "credit", "update", "critic_update")


_reward_rng = np.random.default_rng(0)


def random_reward(prompts, completions, **_):
    """Constant-cost stand-in reward: one uniform [0, 1) number per completion."""
    return _reward_rng.random(len(completions)).tolist()


class PhaseTimes:
    """Accumulates blocked wall time per phase for the current request."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def reset(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def add(self, phase: str, seconds: float):
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


_times = PhaseTimes()


@function_registry.register_advantage_estimator("timed_gae")
def timed_gae(**kwargs):
    """tunix's GAE estimator, its device work timed as the credit phase."""
    start = time.perf_counter()
    out = jax.block_until_ready(algo_core.compute_gae_advantages(**kwargs))
    _times.add("credit", time.perf_counter() - start)
    return out


class ValueModel(nnx.Module):
    """PPO's critic as tunix runs it: the policy's trunk (embedding, decoder layers, final norm,
    copied) with a linear value head; called as tunix's `common.compute_score` calls a model,
    it returns ([B, L, 1] values, no cache)."""

    def __init__(self, trunk, *, rngs: nnx.Rngs):
        self.embedder, self.layers, self.final_norm = trunk.embedder, trunk.layers, trunk.final_norm
        zero = nnx.initializers.zeros
        self.value_head = nnx.Linear(trunk.config.embed_dim, 1, kernel_init=zero, bias_init=zero, rngs=rngs)

    def __call__(self, input_tokens, positions, cache, attention_mask, segment_ids=None):
        x = self.embedder.encode(input_tokens)
        for layer in self.layers:
            _, x = layer(x, positions, None, attention_mask, segment_ids=segment_ids)
        return self.value_head(self.final_norm(x)).astype(jnp.float32), None


class RlStep:
    """An RLCluster + learner for one (algo, request shape), with its phases timed."""

    def __init__(self, algo, ref_graphdef, ref_state, mesh, prompt_length, max_new_tokens, samples, temperature):
        self.max_new_tokens = max_new_tokens
        # Reference: the loaded weights themselves (never trained). Actor (and PPO's critic trunk):
        # a copy, as in tunix's GRPO CLI (`nnx.merge(graph_def, jax.tree.map(jnp.copy, params))`).
        copy = lambda: nnx.merge(ref_graphdef, jax.tree.map(jnp.copy, ref_state))
        reference, actor = nnx.merge(ref_graphdef, ref_state), copy()
        critic = ValueModel(copy(), rngs=nnx.Rngs(0)) if algo == "ppo" else None

        rollout_config = base_rollout.RolloutConfig(
            max_tokens_to_generate=max_new_tokens,
            max_prompt_length=prompt_length,  # prompts are exactly this long: no left padding
            kv_cache_size=prompt_length + max_new_tokens,
            temperature=temperature,
            top_p=1.0,  # with top_k None: plain jax.random.categorical over logits / T
            top_k=None,
            eos_tokens=[NO_TOKEN],
        )
        adamw = lambda: optax.adamw(learning_rate=LEARNING_RATE, b1=ADAM_B1, b2=ADAM_B2, weight_decay=WEIGHT_DECAY)
        training_config = rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=adamw(),
            critic_optimizer=adamw() if critic is not None else None,
            eval_every_n_steps=10**9,  # no eval set is ever given
            max_steps=None,  # set before each call to the number of steps so far + 1
            # mini batch, train/rollout/logps micro batches all left None: the learner then uses
            # the whole batch for each (one optimizer update, no gradient accumulation, so no
            # optax.MultiSteps wrapper; one rollout and one logps call).
            mini_batch_size=None,
            train_micro_batch_size=None,
            rollout_micro_batch_size=None,
            compute_logps_micro_batch_size=None,
            checkpoint_root_directory=None,
            metrics_logging_options=None,
        )
        roles = [rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT]
        roles += [rl_cluster_lib.Role.CRITIC] if critic is not None else []
        cluster_config = rl_cluster_lib.ClusterConfig(
            role_to_mesh=dict.fromkeys(roles, mesh),
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=training_config,
            rollout_config=rollout_config,
        )
        self.cluster = rl_cluster_lib.RLCluster(
            actor=actor,
            reference=reference,
            critic=critic,
            tokenizer=TokenIdTokenizer(),
            cluster_config=cluster_config,
        )
        if algo == "grpo":
            config = grpo_learner.GRPOConfig(
                num_generations=samples, num_iterations=NUM_ITERATIONS, beta=BETA, epsilon=EPSILON
            )
            self.learner = grpo_learner.GRPOLearner(
                rl_cluster=self.cluster, algo_config=config, reward_fns=random_reward
            )
        else:
            config = ppo_learner.PPOConfig(
                num_iterations=NUM_ITERATIONS, beta=BETA, epsilon=EPSILON, advantage_estimator="timed_gae"
            )
            self.learner = ppo_learner.PPOLearner(rl_cluster=self.cluster, ppo_config=config, reward_fns=random_reward)
        self._wrap_phases()

    def _wrap_phases(self):
        cluster, n = self.cluster, self.max_new_tokens

        def timed(phase, fn, ready):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                jax.block_until_ready(ready(out))
                _times.add(phase, time.perf_counter() - start)
                return out

            return wrapper

        def rollout_ready(out):
            lengths = {len(t) for t in out.tokens}
            if lengths != {n}:
                fail(f"rollout returned rows of {sorted(lengths)} tokens, expected exactly {n}")
            return out.tokens  # host numpy already (the Sampler device_gets the buffer)

        def trained(trainer):
            return lambda _: (nnx.state(trainer.model), nnx.state(trainer.optimizer))

        # Instance attributes shadow the methods; the learners call them via self.rl_cluster.
        cluster.generate = timed("rollout", cluster.generate, rollout_ready)
        cluster.get_ref_per_token_logps = timed("scoring", cluster.get_ref_per_token_logps, lambda out: out)
        cluster.get_old_per_token_logps = timed("scoring", cluster.get_old_per_token_logps, lambda out: out)
        cluster.update_actor = timed("update", cluster.update_actor, trained(cluster.actor_trainer))
        if getattr(cluster, "critic_trainer", None) is not None:
            cluster.get_values = timed("values", cluster.get_values, lambda out: out)
            cluster.update_critic = timed("critic_update", cluster.update_critic, trained(cluster.critic_trainer))

    def run(self, prompts: np.ndarray) -> dict:
        _times.reset()
        trainer = self.cluster.actor_trainer
        steps_before = trainer.train_steps
        # The learner loops over global steps until the data runs out or the actor has made
        # max_steps updates; ending it by max_steps after exactly one more update avoids a
        # second, empty pass through its data thread.
        self.cluster.cluster_config.training_config.max_steps = steps_before + 1
        start = time.perf_counter()
        self.learner.train([{"prompts": prompts}])
        jax.block_until_ready((nnx.state(trainer.model), nnx.state(trainer.optimizer)))
        total = time.perf_counter() - start
        if trainer.train_steps != steps_before + 1:
            fail(f"expected one actor update, the trainer made {trainer.train_steps - steps_before}")
        return {**{f"{phase}_s": _times.seconds[phase] for phase in PHASES}, "total_s": total}


def main(model_dir: str) -> None:
    # One device; a trivial mesh with the axis names tunix's Qwen3 sharding rules and the RL
    # trainer's data sharding ("fsdp") refer to. All roles share it (colocated actor/rollout).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    config, reference = load_model(model_dir, mesh)
    ref_graphdef, ref_state = nnx.split(reference)
    del reference
    step: RlStep | None = None
    step_key = None
    reply({"ready": True, "jax": jax.__version__, "tunix": importlib.metadata.version("google-tunix")})

    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        prompts, max_new_tokens, prompt_length = check_request(request, config.vocab_size)
        algo = request.get("algo", "grpo")
        samples, temperature = int(request["samples"]), float(request.get("temperature", 1.0))
        if algo not in ALGOS:
            fail(f"algo={algo!r}: expected one of {ALGOS}")
        if algo == "grpo" and samples < 2:
            fail(f"GRPO needs samples >= 2, got {samples}")
        if algo == "ppo" and samples != 1:
            fail(f"PPO samples each prompt once (repeat a prompt to sample it again), got samples={samples}")
        if not temperature > 0:
            fail(f"temperature must be > 0, got {temperature}")
        key = (algo, len(prompts), prompt_length, max_new_tokens, samples, temperature)
        if key != step_key:
            step = step_key = None
            gc.collect()
            step = RlStep(algo, ref_graphdef, ref_state, mesh, prompt_length, max_new_tokens, samples, temperature)
            step_key = key
        result = step.run(np.asarray(prompts, dtype=np.int32))
        reply({**result, "rows": len(prompts) * samples, "response_tokens": max_new_tokens})


if __name__ == "__main__":
    run_worker(main, "tunix_step_worker.py")
