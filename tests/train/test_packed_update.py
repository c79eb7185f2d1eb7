"""The update on packed minibatches against the sequence layout: losses, metrics and gradients of the
actor (each policy loss's aggregation, the KL, LoRA) and of the critic (TAC, the standard head, the full
value model) equal within float32 rounding, and a jitted step on packed rows moves the params alike."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import packed_batches
import pytest
from update_inputs import CONFIG, HYPER, TOP_K

from comppo_jax.credit.registry import ActorLoss
from comppo_jax.critic import (
    TransportAlignedCritic,
    fused_hidden_layers,
    init_standard_value_head,
    init_tac,
    init_value_model,
)
from comppo_jax.models import init_params, lora
from comppo_jax.rollout import score_rollout
from comppo_jax.train.methods import spread_over_sequence
from comppo_jax.train.update import (
    Minibatch,
    actor_loss,
    adamw,
    apply_actor_step,
    critic_values,
    jit_update_steps,
)

RTOL, ATOL = 1e-5, 1e-6  # float32 rounding: the 1e-5 relative


@functools.cache
def scored_minibatch(seed=0):
    generation = packed_batches.long_tailed_generation(CONFIG.vocab_size, seed, batch=8, response_width=32)
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    actor = init_params(CONFIG, keys[0], init_std=0.2)
    hidden_layers = fused_hidden_layers(CONFIG.num_layers, 2)
    rollout = score_rollout(actor, actor, CONFIG, generation, hidden_layers=hidden_layers, top_k=TOP_K)
    mask = generation.response_mask
    noise = lambda key: jnp.where(mask, jax.random.normal(key, mask.shape), 0.0)
    batch = Minibatch(
        generation.tokens,
        generation.attention_mask,
        generation.prompt_lengths,
        generation.response_tokens,
        mask,
        rollout.log_probs + 0.1 * noise(keys[1]),
        rollout.ref_log_probs + 0.1 * noise(keys[2]),
        noise(keys[3]),
        jnp.tanh(noise(keys[4])),
        jnp.zeros(mask.shape),
        spread_over_sequence(rollout.kappa, generation.prompt_lengths, generation.tokens.shape[1]),
        rollout.hidden_states,
        rollout.routing,
    )
    return actor, batch, packed_batches.packing_of(generation.attention_mask)


def assert_metrics_close(got, want):
    for name in want:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=RTOL, atol=ATOL, err_msg=name)


def assert_trees_close(got, want, rtol=RTOL):
    """Every leaf within `rtol` of the sequence layout's, relative to the leaf's largest magnitude (a
    gradient's small entries are sums that cancel; their rounding is relative to the terms, not the sum)."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(float(np.max(np.abs(y))), 1e-30) if y.size else 1.0
        error = float(np.max(np.abs(x - y))) / scale if y.size else 0.0
        assert error <= rtol, f"{jax.tree_util.keystr(path)}: max |difference| / max |value| = {error:.2e}"


@pytest.mark.parametrize(
    "loss",
    [
        ActorLoss(),  # PPO: token-mean, the KL term
        ActorLoss(aggregation="seq-mean-token-mean", kl_aggregation="seq-mean-token-mean"),  # GRPO's
        ActorLoss(aggregation="seq-mean-token-sum-norm", norm_length=32, kl_term=False),  # Dr. GRPO's
        ActorLoss(policy_loss="gspo", aggregation="seq-mean-token-mean"),
    ],
    ids=["ppo", "grpo", "dr_grpo", "gspo"],
)
def test_the_actor_loss_and_its_gradients_on_packed_rows_equal_the_sequence_layouts(loss):
    actor, batch, packing = scored_minibatch()
    assert packing.segment_ids.shape[0] < batch.tokens.shape[0]
    run = lambda b: jax.value_and_grad(actor_loss, has_aux=True)(actor, CONFIG, b, 0.2, 0.01, loss)
    (value, metrics), grads = run(batch)
    (packed_value, packed_metrics), packed_grads = run(batch._replace(packing=packing))
    np.testing.assert_allclose(packed_value, value, rtol=RTOL)
    assert_metrics_close(packed_metrics, metrics)
    assert_trees_close(packed_grads, grads)


@pytest.mark.parametrize("kind", ["tac", "standard", pytest.param("full", marks=pytest.mark.slow)])
def test_critic_values_and_their_gradients_on_packed_rows_equal_the_sequence_layouts(kind):
    actor, batch, packing = scored_minibatch()
    module = TransportAlignedCritic(bottleneck=8, query_block=4) if kind == "tac" else None
    if kind == "tac":
        critic = init_tac(module, jax.random.PRNGKey(3), batch.hidden_states.shape[0], CONFIG.hidden_size, TOP_K)
    elif kind == "full":
        critic = init_value_model(actor, jnp.float32, jax.random.PRNGKey(3))
    else:
        critic = jax.tree.map(lambda x: x + 0.1, init_standard_value_head(CONFIG.hidden_size))

    def loss(params, b):
        values = critic_values(params, b, critic_module=module, kind=kind, model_config=CONFIG)
        return jnp.sum(jnp.where(b.response_mask, (values - b.returns) ** 2, 0.0)), values

    run = jax.jit(jax.value_and_grad(loss, has_aux=True))  # one program, not TAC's ops one by one (~2x faster)
    (value, values), grads = run(critic, batch)
    (packed_value, packed_values), packed_grads = run(critic, batch._replace(packing=packing))
    mask = np.asarray(batch.response_mask)
    np.testing.assert_allclose(np.asarray(packed_values)[mask], np.asarray(values)[mask], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(packed_value, value, rtol=RTOL)
    assert_trees_close(packed_grads, grads)


@pytest.mark.parametrize("with_lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_a_jitted_actor_step_on_a_packed_minibatch_moves_the_params_as_the_sequence_layouts(with_lora):
    actor, batch, _ = scored_minibatch()
    if with_lora:
        adapters = lora.init_adapters(CONFIG, lora.LoraConfig(rank=4, targets=("q", "v")), jax.random.PRNGKey(5))
        adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # B != 0: every adapter has a gradient
        actor = lora.join(actor, adapters)
    tx = adamw(1e-3)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    rows = np.asarray([5, 0, 3, 6])  # the minibatch the learner picks, selected inside the step
    minibatch_mask = np.asarray(batch.attention_mask)[rows]
    packing = packed_batches.packing_of(minibatch_mask)
    results = []
    for packed in (None, packing):
        copy = jax.tree.map(jnp.array, actor)
        opt = tx.init(lora.trainable(copy))
        steps = jit_update_steps(mesh, dict(actor=copy, actor_opt=opt), model_config=CONFIG, actor_tx=tx)
        with jax.set_mesh(mesh):
            results.append(
                apply_actor_step(steps, copy, opt, batch._replace(packing=packed), HYPER["actor"], jnp.asarray(rows))
            )
    (padded_actor, _, padded_metrics), (packed_actor, _, packed_metrics) = results
    assert_metrics_close(packed_metrics, padded_metrics)
    assert_trees_close(packed_actor, padded_actor)
