"""Supervised warm start on worked solutions (the tiny default's "imperfect but non-zero" policy).

Cross-entropy of the solution tokens (and the EOS) given the prompt, token-mean over the batch,
AdamW; the prompt tokens carry no loss. The solutions may carry taught mistakes
(comppo_jax.data.synthetic.noisy_solution), which give RL something verifiable to fix in minutes on
a CPU.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from comppo_jax import storage
from comppo_jax.data.synthetic import NO_NOISE, Noise, noisy_solution
from comppo_jax.data.tokenizers import pad_batch
from comppo_jax.models import ModelConfig
from comppo_jax.rollout import policy_token_stats
from comppo_jax.train.progress import StepBar, first_call_notices
from pallas_kernels.common import round_up

# Batches are padded to a multiple of this many tokens, so the jitted step compiles once per
# bucket instead of once per new longest row (each compile is seconds; a padded token is not).
LENGTH_BUCKET = 16


def supervised_batch(tokenizer, problems, rng: np.random.Generator, batch_size: int, noise: Noise = NO_NOISE):
    """(tokens, mask, prompt_lengths, response_tokens, response_mask) for random problems, right-padded
    to a multiple of `LENGTH_BUCKET` tokens."""
    chosen = [problems[i] for i in rng.integers(0, len(problems), batch_size)]
    prompts = [tokenizer.encode_prompt(p.prompt) for p in chosen]
    responses = [tokenizer.encode(noisy_solution(p, rng, noise)) + [tokenizer.eos_token_id] for p in chosen]
    rows = [p + r for p, r in zip(prompts, responses)]
    bucketed = lambda lists: round_up(max(map(len, lists)), LENGTH_BUCKET)
    tokens, mask = pad_batch(rows, tokenizer.pad_token_id, side="right", length=bucketed(rows))
    response_tokens, response_mask = pad_batch(
        responses, tokenizer.pad_token_id, side="right", length=bucketed(responses)
    )
    prompt_lengths = np.array([len(p) for p in prompts], np.int32)
    return tuple(jnp.asarray(x) for x in (tokens, mask, prompt_lengths, response_tokens, response_mask))


@functools.partial(jax.jit, static_argnames=("config", "tx"))
def supervised_step(params, opt_state, batch, *, config: ModelConfig, tx):
    tokens, mask, prompt_lengths, response_tokens, response_mask = batch

    def loss(params):
        log_probs, _ = policy_token_stats(params, config, tokens, mask, prompt_lengths, response_tokens)
        return -jnp.sum(jnp.where(response_mask, log_probs, 0.0)) / jnp.maximum(response_mask.sum(), 1)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def warm_start(
    params,
    config: ModelConfig,
    tokenizer,
    problems,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    noise: Noise = NO_NOISE,
    progress: bool = False,
    check_stop=None,
):
    """`steps` AdamW steps of supervised learning on `problems`' solutions; returns (params, last loss).
    `progress`: a compile notice and a bar with the loss (read every 20 steps, so dispatch stays ahead
    of the device).
    `check_stop(stage)` runs every 20 steps (the train loop's stop check, which may raise)."""
    tx = optax.adamw(learning_rate, b1=0.9, b2=0.999, weight_decay=0.0)
    opt_state = jax.jit(tx.init)(params)  # one program, not an eager op per leaf
    rng = np.random.default_rng(seed)
    loss = float("nan")
    first_call_notices(progress)("the warm start")
    bar = StepBar(range(steps), desc="warm start", disable=not progress)
    for step in bar:
        params, opt_state, loss = supervised_step(
            params,
            opt_state,
            supervised_batch(tokenizer, problems, rng, batch_size, noise),
            config=config,
            tx=tx,
        )
        if step % 20 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{float(loss):.3f}")
            if check_stop is not None:
                check_stop(f"the warm start (step {step + 1} of {steps}; it starts over when the run is started again)")
    return params, float(loss)


def cached_warm_start(cache_dir: str, key: dict, template, compute):
    """compute() -> (params, loss), kept on disk under `cache_dir` by a hash of `key` (a JSON-able dict
    of everything the result depends on).

    The file is an .npz of the params (floats stored as float32, cast back to the template's
    dtypes: exact for float32 and bfloat16) written atomically, so concurrent runs may share it.
    A file that does not read back (damaged, or missing leaves) is a cache miss: it is set aside
    as `<file>.damaged-<time>` with a warning naming it, and the result is computed again.
    """
    text = json.dumps(key, sort_keys=True)
    path = storage.path(cache_dir) / f"warm_start_{hashlib.sha256(text.encode()).hexdigest()[:16]}.npz"
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    if path.exists():
        try:
            with np.load(io.BytesIO(path.read_bytes())) as stored:
                missing = [n for n in names if n not in stored.files] + ([] if "loss" in stored.files else ["loss"])
                if missing:
                    raise KeyError(f"no {missing[0]} ({len(missing)} missing)")
                params = [jnp.asarray(stored[n]).astype(leaf.dtype) for n, (_, leaf) in zip(names, leaves)]
                return jax.tree_util.tree_unflatten(treedef, params), float(stored["loss"])
        except Exception as error:  # zip, npy and key errors of a damaged file: it is only a cache
            aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
            storage.move(path, aside)
            logging.warning(
                "warm-start cache %s cannot be read (%s: %s): set aside as %s; the warm start runs again",
                path,
                type(error).__name__,
                error,
                aside,
            )
    params, loss = compute()
    arrays = {
        n: np.asarray(jnp.asarray(x, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x)
        for n, x in zip(names, jax.tree.leaves(params))
    }
    # Processes of a multi-host run may share the directory: each file is written whole (storage.write_bytes).
    data = io.BytesIO()
    np.savez(data, loss=np.float64(loss), **arrays)
    storage.write_bytes(path, data.getvalue())
    storage.write_text(path.with_suffix(".json"), text)
    return params, loss
