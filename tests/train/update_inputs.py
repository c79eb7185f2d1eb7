"""A tiny model, TAC critic and a scored minibatch, for the update-step tests (also run in subprocesses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from tiny_model import tiny_config

from comppo_jax.critic import TransportAlignedCritic, fused_hidden_layers, init_tac
from comppo_jax.models import init_params
from comppo_jax.rollout import score_rollout
from comppo_jax.rollout.sampler import Generation
from comppo_jax.train.methods import spread_over_sequence
from comppo_jax.train.update import Minibatch, adamw

CONFIG = tiny_config()
TOP_K = 4
HYPER = {
    "actor": dict(learning_rate=1e-3, clip=0.2, kl_coef=2e-3, grad_clip=1.0),
    "critic": dict(learning_rate=1e-3, value_clip=0.5, grad_clip=1.0),
}


def update_inputs(batch: int = 8, prompt: int = 6, response: int = 10, seed: int = 0):
    """(actor, actor_opt, actor_tx, critic_module, critic, critic_opt, critic_tx, minibatch) on one device."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    actor = init_params(CONFIG, keys[0], init_std=0.2)
    tokens = jax.random.randint(keys[1], (batch, prompt + response), 2, CONFIG.vocab_size)
    lengths = jnp.arange(batch) % (response - 2) + 3  # varied response lengths, right padded
    response_mask = jnp.arange(response)[None, :] < lengths[:, None]
    attention_mask = jnp.concatenate([jnp.ones((batch, prompt), bool), response_mask], axis=1)
    tokens = jnp.where(attention_mask, tokens, 0)
    generation = Generation(
        tokens,
        attention_mask,
        jnp.full((batch,), prompt, jnp.int32),
        tokens[:, prompt:],
        response_mask,
        jnp.zeros((batch, response)),
    )
    hidden_layers = fused_hidden_layers(CONFIG.num_layers, 2)
    rollout = score_rollout(
        actor, actor, CONFIG, generation, window="response", temperature=1.0, hidden_layers=hidden_layers, top_k=TOP_K
    )
    critic_module = TransportAlignedCritic(bottleneck=8, query_block=4)
    critic = init_tac(critic_module, keys[2], len(hidden_layers), CONFIG.hidden_size, TOP_K)
    actor_tx, critic_tx = adamw(1e-3), adamw(1e-3)
    noise = lambda key: jnp.where(response_mask, jax.random.normal(key, response_mask.shape), 0.0)
    minibatch = Minibatch(
        tokens,
        attention_mask,
        generation.prompt_lengths,
        generation.response_tokens,
        response_mask,
        rollout.log_probs + 0.1 * noise(keys[3]),
        rollout.ref_log_probs,
        noise(keys[4]),
        jnp.tanh(noise(keys[5])),
        jnp.zeros(response_mask.shape),
        spread_over_sequence(rollout.kappa, generation.prompt_lengths, tokens.shape[1]),
        rollout.hidden_states,
        rollout.routing,
    )
    return actor, actor_tx.init(actor), actor_tx, critic_module, critic, critic_tx.init(critic), critic_tx, minibatch
