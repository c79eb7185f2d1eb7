"""The update: actor clipped PPO + reference KL, critic clipped value regression (paper alg. 1).

Pure functions over plain pytrees. `jit_update_steps` jits them over a device mesh with
explicit in/out shardings (comppo_jax.sharding) and donated params and optimizer states, each
also reading its minibatch's rows of a whole batch (`on_rows`), selected inside its program.
Per-step knobs from the phase controller (learning rates, clip, KL coefficient, value clip,
gradient clips) enter as traced scalars, so a phase change does not recompile. Learning rates
live in the optax state (`inject_hyperparams`), so they are checkpointed with it.

Mixed precision: the actor's params may be kept in a wider master dtype (float32) than the
model's compute dtype (`config.dtype`, bfloat16 in the presets); the loss casts them down, so
gradients and AdamW moments stay in the master dtype. With LoRA (comppo_jax.models.lora) only the
adapters are trained, kept in the master dtype; the frozen base stays in the compute dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from comppo_jax.credit import kl_penalty, masked_mean, value_loss
from comppo_jax.credit.losses import entropy_top_mask
from comppo_jax.credit.registry import ActorLoss, surrogate
from comppo_jax.critic import Routing, standard_value_head, value_model_values
from comppo_jax.models import ModelConfig, lora
from comppo_jax.models.packing import Packing, pack, pack_positions
from comppo_jax.rollout import policy_token_stats
from comppo_jax.rollout.scoring import model_rows, read_response
from comppo_jax.sharding import batch_sharding, features_sharding, replicated, tree_shardings


class Minibatch(NamedTuple):
    """Everything one gradient step reads; per-token arrays [B, T], sequence arrays [B, L]. With a
    `packing` (comppo_jax.models.packing) of exactly these rows, the model and critic run on its packed
    rows; the per-token arrays stay per sequence, so credit and every loss aggregation are the same."""

    tokens: jax.Array
    attention_mask: jax.Array
    prompt_lengths: jax.Array
    response_tokens: jax.Array
    response_mask: jax.Array
    old_log_probs: jax.Array
    ref_log_probs: jax.Array
    advantages: jax.Array
    returns: jax.Array
    old_values: jax.Array
    kappa_sequence: jax.Array  # [B, L] the (control) gate at the critic's positions
    hidden_states: jax.Array  # [L', B, L, D] behaviour features the critic reads
    routing: Routing | None
    packing: Packing | None = None  # these rows packed (None: the model runs on the sequence layout)


def minibatch_shardings(mesh: Mesh, with_routing: bool, hidden_size: int) -> Minibatch:
    """Rows split over (data, fsdp); the hidden states carry the batch on axis 1 and their width
    over `tensor` (`sharding.features_spec`); a packing is read as the learner placed it (rows split
    over (data, fsdp) too)."""
    rows = batch_sharding(mesh)
    fields = dict.fromkeys(Minibatch._fields, rows)
    fields.update(
        hidden_states=features_sharding(mesh, hidden_size),
        routing=Routing(rows, rows, rows) if with_routing else None,
        packing=None,
    )
    return Minibatch(**fields)


def take_rows(batch: Minibatch, rows) -> Minibatch:
    """The minibatch of `rows` (hidden states carry the batch on axis 1): traced inside a step
    (`on_rows`), or of host arrays. Its `packing` is left as it is: the learner sets the minibatch's."""
    pick = lambda x: None if x is None else x[rows]
    kept = ("hidden_states", "routing", "packing")
    return batch._replace(
        **{name: pick(getattr(batch, name)) for name in batch._fields if name not in kept},
        hidden_states=batch.hidden_states[:, rows],
        routing=None if batch.routing is None else jax.tree.map(lambda x: x[rows], batch.routing),
    )


def on_rows(step: Callable, shardings: Minibatch) -> Callable:
    """`step` on the minibatch of `rows` of a whole `batch` (rows None: `batch` is the minibatch),
    selected inside its program and laid out as `step`'s minibatch argument is (`shardings`), so
    it computes what `step` does on that minibatch. One program per minibatch: selected eagerly,
    each field is a gather of its own, on a pod a cross-process program (XLA:CPU over gloo hangs
    on such programs back to back: docs/reliability.md)."""

    def step_on_rows(params, opt_state, batch: Minibatch, rows, *args):
        minibatch = batch if rows is None else take_rows(batch, rows)
        laid_out = jax.tree.map(  # a field without a sharding (routing no critic reads) as it comes
            lambda s, x: x if s is None else jax.lax.with_sharding_constraint(x, s),
            shardings,
            minibatch,
            is_leaf=lambda s: s is None,
        )
        return step(params, opt_state, laid_out, *args)

    return step_on_rows


def cast_params(params, dtype):
    """params in `dtype` (the compute copy of fp32 master weights; a no-op when equal)."""
    return jax.tree.map(lambda p: p.astype(dtype), params)


def adamw(learning_rate: float) -> optax.GradientTransformation:
    """AdamW (0.9, 0.999), weight decay 0 (appendix C), with an injectable learning rate."""
    return optax.inject_hyperparams(optax.adamw)(learning_rate=learning_rate, b1=0.9, b2=0.999, weight_decay=0.0)


def _clip_and_apply(tx, params, opt_state, grads, learning_rate, max_norm, losses):
    """Clips and applies `grads`; when a loss in `losses` or the gradient norm is not finite the
    update is skipped: params and optimizer state come back unchanged, with finite=False."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.all(jnp.isfinite(jnp.stack(losses)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, max_norm / (grad_norm + 1e-6)), grads)
    opt_state.hyperparams["learning_rate"] = jnp.asarray(learning_rate, jnp.float32)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    keep_if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return (
        keep_if_finite(optax.apply_updates(params, updates), params),
        keep_if_finite(new_opt_state, opt_state),
        grad_norm,
        finite,
    )


def actor_loss(params, config: ModelConfig, batch: Minibatch, clip, kl_coef, loss: ActorLoss = ActorLoss()):
    """Clipped surrogate (`surrogate`) + kl_coef * low-variance KL to the reference policy, the KL
    aggregated as `loss.kl_aggregation`; without a KL term (`loss.kl_term=False`, DAPO) the
    surrogate alone, and no kl_loss metric. With `loss.token_selection="entropy_top"` the surrogate
    counts only the minibatch's highest-entropy tokens under these params (`entropy_top_mask`)."""
    log_probs, entropy = policy_token_stats(
        cast_params(params, config.dtype),
        config,
        batch.tokens,
        batch.attention_mask,
        batch.prompt_lengths,
        batch.response_tokens,
        loss.temperature,
        batch.packing,
    )
    mask = batch.response_mask
    on_tokens = functools.partial(surrogate, loss, log_probs, batch.old_log_probs, batch.advantages)
    policy_loss, stats = on_tokens(mask, clip)
    selection = {}
    if loss.token_selection == "entropy_top":
        # As Wang et al.'s code (2025): the surrogate aggregated over the kept tokens alone (a token-mean divides
        # by their count); its clip fraction and ppo_kl, like the KL term below, still over every valid token.
        kept, threshold = entropy_top_mask(entropy, mask, loss.token_selection_fraction)
        policy_loss = on_tokens(kept, clip)[0]
        selection = {
            "token_selection/kept_fraction": masked_mean(kept.astype(jnp.float32), mask),
            "token_selection/entropy_threshold": threshold,
        }
    entropy = masked_mean(entropy, mask)
    metrics = {
        "policy_loss": policy_loss,
        "ppo_kl": stats["approx_kl"],
        "clip_fraction": stats["clip_fraction"],
        "clip_fraction_high": stats["clip_fraction_high"],
        "entropy": jax.lax.stop_gradient(entropy),
        **selection,
    }
    if not loss.kl_term:
        return policy_loss, metrics
    kl = kl_penalty(log_probs, batch.ref_log_probs, mask, aggregation=loss.kl_aggregation, norm_length=loss.norm_length)
    return policy_loss + kl_coef * kl, {**metrics, "kl_loss": kl}


def actor_step(
    params,
    opt_state,
    batch: Minibatch,
    hyper: dict,
    frozen=None,
    *,
    config: ModelConfig,
    tx,
    loss: ActorLoss = ActorLoss(),
):
    """One actor update of `params` (every weight, or a LoRA run's adapters beside the `frozen`
    base: comppo_jax.models.lora); hyper: learning_rate, clip, kl_coef, grad_clip (traced scalars).
    Skipped (params and optimizer state unchanged, actor_finite=False) on a non-finite loss or gradient."""
    policy_loss = lambda params, *args: actor_loss(lora.join(frozen, params), *args)
    grads, metrics = jax.grad(policy_loss, has_aux=True)(params, config, batch, hyper["clip"], hyper["kl_coef"], loss)
    losses = (metrics["policy_loss"],) + ((metrics["kl_loss"],) if loss.kl_term else ())
    params, opt_state, grad_norm, finite = _clip_and_apply(
        tx, params, opt_state, grads, hyper["learning_rate"], hyper["grad_clip"], losses
    )
    return params, opt_state, {**metrics, "grad_norm": grad_norm, "actor_finite": finite}


def critic_values(
    critic_params, batch: Minibatch, *, critic_module, kind: str, model_config: ModelConfig | None = None
):
    """V_t [B, T] at the response positions, from TAC, the standard head on the actor's features, or
    the full value model on the tokens (`model_config`: its architecture); TAC's and the standard head's
    clamped to [-1, 1], the full value model's not (as in tunix and verl). With a `batch.packing` the
    critic runs on the packed rows (the features packed, the routed keys moved to their packed slots)."""
    packing = batch.packing
    laid_out = (lambda x: x) if packing is None else (lambda x: pack(x, packing))
    if kind == "tac":
        routing = batch.routing
        if packing is not None:
            routing = Routing(
                pack_positions(routing.indices, packing), laid_out(routing.weights), laid_out(routing.valid)
            )
        sequence = critic_module.apply(
            {"params": critic_params}, jax.vmap(laid_out)(batch.hidden_states), routing, laid_out(batch.kappa_sequence)
        ).value
    elif kind == "full":
        tokens, mask, packed = model_rows(batch.tokens, batch.attention_mask, packing)
        sequence = value_model_values(critic_params, model_config, tokens, mask, **packed)
    else:
        sequence = standard_value_head(critic_params, laid_out(batch.hidden_states[-1]))
    return read_response(sequence, batch.prompt_lengths, batch.response_mask.shape[1], packing)


def critic_step(
    params,
    opt_state,
    batch: Minibatch,
    hyper: dict,
    *,
    critic_module,
    kind: str,
    tx,
    model_config: ModelConfig | None = None,
):
    """One critic update toward the detached G_t; hyper: learning_rate, value_clip, grad_clip.
    Skipped (critic_finite=False) on a non-finite loss or gradient, as `actor_step`."""

    def loss(params):
        values = critic_values(params, batch, critic_module=critic_module, kind=kind, model_config=model_config)
        return value_loss(values, batch.old_values, batch.returns, batch.response_mask, hyper["value_clip"])

    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    params, opt_state, grad_norm, finite = _clip_and_apply(
        tx, params, opt_state, grads, hyper["learning_rate"], hyper["grad_clip"], (value,)
    )
    return (
        params,
        opt_state,
        {
            "value_loss": value,
            "value_clip_fraction": stats["clip_fraction"],
            "critic_grad_norm": grad_norm,
            "critic_finite": finite,
        },
    )


class UpdateSteps(NamedTuple):
    """The jitted, sharded steps of one run (critic entries are None without a critic)."""

    # (trainable, opt_state, minibatch, hyper, frozen) -> (trainable, opt_state, metrics); see `apply_actor_step`
    actor: Callable
    critic: Callable | None  # (params, opt_state, minibatch, hyper) -> (params, opt_state, metrics)
    values: Callable | None  # (params, batch) -> V [B, T]
    # The same steps on the minibatch of `rows` of a whole batch, selected inside their programs (`on_rows`):
    actor_on_rows: Callable  # (trainable, opt_state, batch, rows, hyper, frozen) -> (trainable, opt_state, metrics)
    critic_on_rows: Callable | None  # (params, opt_state, batch, rows, hyper) -> (params, opt_state, metrics)


def apply_actor_step(steps: UpdateSteps, actor, opt_state, batch: Minibatch, hyper: dict, rows=None):
    """(actor, opt_state, metrics) after `steps.actor_on_rows` on the minibatch of `rows` of `batch`
    (rows None: `batch` is the minibatch), on the actor's trainable part (all of it, or its LoRA
    adapters), the frozen base passed beside it unchanged."""
    trainable, frozen = lora.split(actor)
    trainable, opt_state, metrics = steps.actor_on_rows(trainable, opt_state, batch, rows, hyper, frozen)
    return lora.join(frozen, trainable), opt_state, metrics


def jit_update_steps(
    mesh: Mesh,
    state: dict,
    *,
    model_config: ModelConfig,
    actor_tx,
    critic_tx=None,
    critic_module=None,
    critic_kind: str = "none",
    actor_loss: ActorLoss = ActorLoss(),
) -> UpdateSteps:
    """`actor_step` (with the surrogate `actor_loss`), `critic_step` and `critic_values` as jax.jit
    with in/out shardings on `mesh` for the `state`'s actor, actor_opt, critic and critic_opt
    (arrays or ShapeDtypeStructs; critic None: no critic); the two steps also `on_rows`."""
    actor, actor_opt, critic, critic_opt = (state.get(name) for name in ("actor", "actor_opt", "critic", "critic_opt"))
    rep = replicated(mesh)
    batch = minibatch_shardings(mesh, with_routing=critic_kind == "tac", hidden_size=model_config.hidden_size)
    (trainable_sh, frozen_sh), actor_opt_sh = (
        (tree_shardings(mesh, part) for part in lora.split(actor)),
        tree_shardings(mesh, actor_opt),
    )

    def minibatch_and_rows_steps(step, state: tuple, after_batch: tuple) -> tuple[Callable, Callable]:
        """`step` jitted on a minibatch and `on_rows`, its `state` shardings (params, optimizer state) donated.
        On rows, the whole batch is read as it lies (the learner's credit and the critic's freed features leave
        fields laid out otherwise); its minibatch is laid out inside."""
        jitted = lambda fn, batch_args: jax.jit(
            fn, in_shardings=(*state, *batch_args, *after_batch), out_shardings=(*state, rep), donate_argnums=(0, 1)
        )
        return jitted(step, (batch,)), jitted(on_rows(step, batch), (None, rep))

    # The frozen base is read, never donated: the reference policy is the same arrays.
    actor_fn, actor_on_rows = minibatch_and_rows_steps(
        functools.partial(actor_step, config=model_config, tx=actor_tx, loss=actor_loss),
        (trainable_sh, actor_opt_sh),
        (rep, frozen_sh),
    )
    if critic is None:
        return UpdateSteps(actor_fn, None, None, actor_on_rows, None)
    critic_sh, critic_opt_sh = tree_shardings(mesh, critic), tree_shardings(mesh, critic_opt)
    critic_fn, critic_on_rows = minibatch_and_rows_steps(
        functools.partial(
            critic_step, critic_module=critic_module, kind=critic_kind, tx=critic_tx, model_config=model_config
        ),
        (critic_sh, critic_opt_sh),
        (rep,),
    )
    values_fn = jax.jit(
        functools.partial(critic_values, critic_module=critic_module, kind=critic_kind, model_config=model_config),
        in_shardings=(critic_sh, batch),
        out_shardings=batch.advantages,
    )
    return UpdateSteps(actor_fn, critic_fn, values_fn, actor_on_rows, critic_on_rows)
