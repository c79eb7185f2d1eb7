"""The learner stage: credit -> update epochs -> guards -> controller.

`credit_fields` turns one scored `Experience` into a `Scored` batch: the method's gate control, the
critic's values V_t on the behaviour features, the estimator's advantages (whitened) and returns.
`Learner.update` runs it clipped, weighted by train.rollout_correction's sampler -> scorer weights, and
with the guard's finite flags (`guarded_credit`), then E epochs
of shuffled minibatches (the actor's clipped PPO + KL with the phase controller's knobs, the
critic's clipped value regression: the critic's epochs first, then its features are freed, unless
gate_refresh=epoch refreshes the gate between epochs), and records non-finite credit or updates
with the skipped-update guard.
`Learner.control` feeds the step's metrics to the phase controller.

Each computation on the batch is one jitted program (the credit; the refreshed gate and its credit;
train.proximal=recompute's inputs; each update step), its results read back where the next needs
them: operation by operation, each operation on the batch is, on a pod, a cross-process program, and
XLA:CPU over gloo hangs on those back to back (docs/reliability.md; tests/train/test_learner_dispatch.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from comppo_jax import sharding
from comppo_jax.credit import clip_advantages, decoupled_ppo_inputs, masked_mean, registry
from comppo_jax.credit.losses import importance_weight_stats, rollout_correction
from comppo_jax.models.packing import Packing, efficiency, on_devices, worth_packing
from comppo_jax.rollout import policy_gate, policy_token_stats
from comppo_jax.rollout.experience import GateSpec, Sampled
from comppo_jax.train import controller
from comppo_jax.train.guards import SkippedUpdates, all_finite, nonfinite_credit
from comppo_jax.train.methods import control_gate, spread_over_sequence
from comppo_jax.train.specs import CreditSpec, LearnerSpec
from comppo_jax.train.update import Minibatch, UpdateSteps, apply_actor_step, cast_params, take_rows


class Scored(NamedTuple):
    """A sampled batch after score -> reward -> credit (advantages whitened, not yet clipped)."""

    batch: Minibatch
    rollout: Any  # comppo_jax.rollout.Rollout without the critic's features (kappa: the policy's own gate)
    sampled: Sampled  # the generation, its problems, texts, rewards and verdicts
    kappa: jax.Array  # [B, T] the gate the estimator and critic read (after the control)

    @classmethod
    def of(cls, batch: Minibatch, rollout, sampled: Sampled, kappa) -> Scored:
        # The critic's features live on in `batch` only (no second copy through the update).
        return cls(batch, rollout._replace(hidden_states=None, routing=None), sampled, kappa)


class Signals(NamedTuple):
    """What credit reads of a rollout besides its batch: the policy's own gate kappa [B, T] (before the
    control), the terminal rewards [B], the reward at each row's last token [B, T], the sampler's log-probs [B, T],
    the future attention influence [B, T] (attention_anchor's; None without it)."""

    kappa: Any
    rewards: Any
    reward_tokens: Any
    sampler_log_probs: Any
    influence: Any = None
    env_mask: Any = None  # [B, T] a conversation's environment tokens (None: one turn)

    @classmethod
    def of(cls, rollout, sampled: Sampled) -> Signals:
        generation = sampled.generation
        return cls(
            rollout.kappa,
            sampled.rewards,
            sampled.reward_tokens,
            generation.log_probs,
            rollout.influence,
            sampled.env_mask,
        )

    def estimate(self, spec: registry.EstimatorSpec, response_tokens, values, kappa, mask):
        """(advantages, returns) [B, T] of the estimator `spec` on these signals (`registry.estimate`)."""
        statistics = registry.Statistics(self.influence, self.env_mask)
        return registry.estimate(
            spec, self.rewards, self.reward_tokens, response_tokens, values, kappa, mask, statistics
        )


def rollout_batch(sampled: Sampled, rollout, batch_shardings, packing: Packing | None = None) -> Minibatch:
    """The scored rollout as a Minibatch laid out as `batch_shardings`, without its credit (advantages,
    returns, old_values, kappa_sequence None; ref_log_probs None without a reference): `credit_fields`
    computes those. `packing`: the whole batch's packed rows (the scoring pass's), placed already."""
    generation = sampled.generation
    # The learner's response tokens are the policy's: a conversation's environment tokens get no loss.
    policy_mask = rollout.response_mask if sampled.env_mask is None else sampled.host_mask & ~sampled.env_mask
    batch = Minibatch(
        generation.tokens,
        generation.attention_mask,
        generation.prompt_lengths,
        generation.response_tokens,
        policy_mask,
        rollout.log_probs,
        rollout.ref_log_probs,
        None,
        None,
        None,
        None,
        rollout.hidden_states,
        rollout.routing,
    )
    placed = jax.tree.map(
        lambda x, s: None if x is None else jax.device_put(x, s), batch, batch_shardings, is_leaf=lambda x: x is None
    )
    return placed._replace(packing=packing)


def controlled_gate(credit: CreditSpec, own_kappa, mask, rng):
    """The kappa [B, T] the estimator and the TAC value mix read: the recipe's gate control on the
    behaviour policy's own (`rng`: the shuffled control's key)."""
    return control_gate(credit.recipe, own_kappa, mask, rng, credit.position_schedule, fixed_value=credit.fixed_gate)


def credit_fields(credit: CreditSpec, values_fn, critic, batch: Minibatch, signals: Signals, rng):
    """The credit of a `rollout_batch`: the gate control on the behaviour policy's own kappa, V_t from
    `critic` on the behaviour features, the estimator's advantages (whitened) and returns
    (comppo_jax.credit.registry). Returns (the Minibatch fields it fills: ref_log_probs (zeros without
    a reference), kappa_sequence, old_values, advantages, returns; the controlled kappa [B, T]).
    Traceable: the learner runs it as one program."""
    mask = batch.response_mask
    kappa = controlled_gate(credit, signals.kappa, mask, rng)
    zeros = jnp.zeros(mask.shape)
    fields = dict(
        ref_log_probs=zeros if batch.ref_log_probs is None else batch.ref_log_probs,
        kappa_sequence=spread_over_sequence(kappa, batch.prompt_lengths, batch.tokens.shape[1]),
    )
    if credit.recipe.critic == "none":
        values = zeros
    else:
        values = values_fn(critic, batch._replace(advantages=zeros, returns=zeros, old_values=zeros, **fields))
    advantages, returns = signals.estimate(credit.estimator, batch.response_tokens, values, kappa, mask)
    return dict(fields, old_values=values, advantages=advantages, returns=returns), kappa


def assign_credit(credit: CreditSpec, values_fn, critic, rollout, sampled: Sampled, rng, batch_shardings) -> Scored:
    """The credit of a scored batch (`credit_fields`, operation by operation: eval.held_out's), `rng`
    the gate control's key."""
    batch = rollout_batch(sampled, rollout, batch_shardings)
    fields, kappa = credit_fields(credit, values_fn, critic, batch, Signals.of(rollout, sampled), rng)
    return Scored.of(batch._replace(**fields), rollout, sampled, kappa)


def gate_key(step_rng):
    """The gate control's key (the shuffled gate's) of the step whose key is `step_rng`."""
    return jax.random.fold_in(step_rng, 1)


def guarded_credit(spec: LearnerSpec, values_fn, critic, batch: Minibatch, signals: Signals, step_rng, clip):
    """The learner's credit program: `credit_fields`, the advantages clipped to `clip` and, on a rescored
    batch, times train.rollout_correction's weights (`rollout_correction`: None for none; its metrics, the
    mismatch's whatever the rule), and whether the weights, values, advantages and returns are finite
    (`guards.nonfinite_credit` reads the flags back). One program: its parts dispatched one by one until that
    read were, on a pod, cross-process programs back to back (XLA:CPU over gloo hangs on those:
    docs/reliability.md). Returns (fields, kappa, advantages, the weights, the metrics, the finite flags)."""
    fields, kappa = credit_fields(spec.credit, values_fn, critic, batch, signals, gate_key(step_rng))
    advantages = clip_advantages(fields["advantages"], clip)
    correction = (
        spec.rollout_correction,
        spec.rollout_correction_cap,
        spec.rollout_correction_level,
        spec.rollout_correction_lower_cap,
    )
    # With the sampler's own log-probs as the old ones (rollout.old_log_probs=sampler) the ratio is 1.
    weights, metrics = (
        rollout_correction(signals.sampler_log_probs, batch.old_log_probs, batch.response_mask, *correction)
        if spec.rescored
        else (None, {})
    )
    finite = {} if weights is None else all_finite(**{"rollout correction weights": weights})  # first: its source
    advantages = advantages if weights is None else advantages * weights
    finite.update(all_finite(values=fields["old_values"], advantages=advantages, returns=fields["returns"]))
    return fields, kappa, advantages, weights, metrics, finite


def refreshed_gate(gate: GateSpec, model_config, actor, batch: Minibatch):
    """gate_refresh=epoch: the current actor's gate on the stored batch (H -> c -> kappa [B, T], no
    gradient). The learner runs it as a program of its own: in one with `refreshed_credit`, XLA
    recomputes the gate's last operations inside those that read it, rounding apart."""
    mask = batch.response_mask
    return policy_gate(
        cast_params(actor, model_config.dtype),
        model_config,
        batch.tokens,
        batch.attention_mask,
        batch.prompt_lengths,
        mask,
        length=mask.shape[1],
        packing=batch.packing,
        **gate.options(),
    )


def refreshed_credit(
    credit: CreditSpec, batch: Minibatch, signals: Signals, kappa_before, step_rng, clip, weights=()
) -> tuple[dict, jax.Array]:
    """gate_refresh=epoch: the refreshed gate (`signals.kappa`) through the gate control, and Comp-GAE
    rerun with the stored values and rewards. Returns (the Minibatch fields that change: advantages (whitened,
    clipped to `clip`, times each of `weights`: the rollout correction's, train.proximal=recompute's), returns
    and kappa_sequence; the gate's mean |change| from `kappa_before`). The learner runs it as one program."""
    mask = batch.response_mask
    kappa = controlled_gate(credit, signals.kappa, mask, gate_key(step_rng))
    advantages, returns = signals.estimate(credit.estimator, batch.response_tokens, batch.old_values, kappa, mask)
    advantages = clip_advantages(advantages, clip)
    for weight in weights:
        advantages = advantages * weight
    fields = dict(
        advantages=advantages,
        returns=returns,
        kappa_sequence=spread_over_sequence(kappa, batch.prompt_lengths, batch.tokens.shape[1]),
    )
    return fields, masked_mean(jnp.abs(kappa - kappa_before), mask)


def proximal_inputs(model_config, temperature: float, cap: float, rule: str, actor, batch: Minibatch):
    """train.proximal=recompute, AReaL's decoupled objective (`decoupled_ppo_inputs`). Returns (the
    Minibatch fields that change: old_log_probs, the ratio's reference, now the current (proximal)
    policy's, and the advantages times the capped importance weights; the weights capped at `cap` by
    `rule` (train.importance_weight_rule); importance_weight/mean, /max, /masked_fraction or
    /truncated_fraction; whether the weights and those advantages are finite). One program."""
    proximal = policy_token_stats(
        cast_params(actor, model_config.dtype),
        model_config,
        batch.tokens,
        batch.attention_mask,
        batch.prompt_lengths,
        batch.response_tokens,
        temperature,
        batch.packing,
    )[0]
    old_log_probs, advantages, weights, capped = decoupled_ppo_inputs(
        batch.old_log_probs, proximal, batch.advantages, batch.response_mask, cap, rule
    )
    names = ("mean", "max", f"{'masked' if rule == 'mask' else 'truncated'}_fraction")
    stats = importance_weight_stats(weights, batch.response_mask, cap)
    metrics = {f"importance_weight/{name}": x for name, x in zip(names, stats)}
    finite = all_finite(**{"importance weights": weights, "advantages": advantages})
    return dict(old_log_probs=old_log_probs, advantages=advantages), capped, metrics, finite


def _emptied_features(hidden_states, routing):
    """Zero layers of the critic's features, zero routed keys."""
    return hidden_states[:0], None if routing is None else jax.tree.map(lambda x: x[..., :0], routing)


_emptied_on_device = jax.jit(_emptied_features)  # one program (sliced eagerly, each array is one)


def without_features(batch: Minibatch) -> Minibatch:
    """`batch` with zero layers of the critic's features and zero routed keys (the actor's
    minibatches never read them); host arrays (train.offload_idle) sliced on the host."""
    on_host = isinstance(batch.hidden_states, np.ndarray)
    hidden_states, routing = (_emptied_features if on_host else _emptied_on_device)(batch.hidden_states, batch.routing)
    return batch._replace(hidden_states=hidden_states, routing=routing)


def free_device_arrays(*arrays) -> None:
    """Deletes each distinct device array of `arrays`, however many references remain (host copies
    are left to the garbage collector)."""
    for x in {id(x): x for x in arrays if isinstance(x, jax.Array)}.values():
        x.delete()


class Offload(NamedTuple):
    """train.offload_idle: what the next program does not read waits in host memory."""

    park: Callable  # tree -> host memory
    fetch: Callable  # tree -> device memory
    to_update: Callable  # the update's batch: read one minibatch at a time, the rest waits on the host
    update_on_host: bool  # to_update moves the batch to the host: each minibatch is selected there

    @classmethod
    def of(cls, enabled: bool) -> Offload:
        if not enabled:
            same = lambda tree: tree
            return cls(same, same, same, False)
        return cls(
            lambda tree: sharding.to_memory(tree, "pinned_host"),
            lambda tree: sharding.to_memory(tree, "device"),
            lambda tree: jax.tree.map(sharding.to_host, tree),
            True,
        )


class Learned(NamedTuple):
    """What one update leaves for the recorder."""

    scored: Scored
    batch: Minibatch  # the batch the last epoch read (advantages clipped)
    metrics: dict  # the minibatches' mean losses, norms and clip fractions
    gate_change: float | None  # gate_refresh=epoch: the refreshed gate's mean |change| from the rollout's
    nonfinite: list[str]  # what was not finite (the update skipped), empty when it applied
    applied_actor: bool  # the actor updated (past the critic warm-up)
    importance: dict  # mismatch/..., rollout_correction/... and (proximal=recompute) importance_weight/...


class Learner:
    """Credit and update epochs for each Experience, the guards and the controller (module
    docstring). `control_state` and `skipped` are checkpointed in the run's meta."""

    def __init__(
        self,
        spec: LearnerSpec,
        model_config,
        steps: UpdateSteps,
        batch_shardings,
        offload: Offload,
        meta: dict,
        compiling: Callable[[str], None],
    ):
        self.spec, self.model_config, self.steps = spec, model_config, steps
        self.batch_shardings, self.offload, self.compiling = batch_shardings, offload, compiling
        self.control_config = spec.controller
        self.control_state = meta["controller"]
        self.skipped = SkippedUpdates(
            spec.max_skipped_updates, **meta.get("skipped_updates", {})
        )  # absent before the guard existed
        self.warmup = spec.steps.warmup
        # Packed rows are placed on the batch's mesh and split as a batch's rows are.
        self.mesh = None if batch_shardings is None else batch_shardings.tokens.mesh
        self.row_multiple = 1 if self.mesh is None else sharding.batch_size_multiple(self.mesh)
        # The step's programs besides the update steps (module docstring), jitted once per run.
        self.credit = jax.jit(functools.partial(guarded_credit, spec, steps.values))
        self.refreshed_gate = jax.jit(functools.partial(refreshed_gate, spec.credit.gate, model_config))
        self.refreshed_credit = jax.jit(functools.partial(refreshed_credit, spec.credit))
        self.proximal_inputs = jax.jit(
            functools.partial(
                proximal_inputs,
                model_config,
                spec.actor_loss.temperature,
                spec.importance_weight_cap,
                spec.importance_weight_rule,
            )
        )

    def meta(self) -> dict:
        return {"controller": self.control_state, "skipped_updates": self.skipped.state()}

    def update(self, state: dict, experience, step: int, step_rng) -> tuple[dict, Learned]:
        """Credit and the update epochs of batch `step` (step_rng: the step's key)."""
        spec, steps, offload = self.spec, self.steps, self.offload
        knobs = controller.knobs(self.control_state, spec.steps.schedule_step(step), self.control_config)
        rollout, sampled = experience.rollout, experience.sampled
        batch = rollout_batch(sampled, rollout, self.batch_shardings, experience.packing)
        signals = Signals.of(rollout, sampled)
        fields, kappa, advantages, correction, importance, finite = self.credit(
            state["critic"], batch, signals, step_rng, knobs["advantage_clip"]
        )
        scored = Scored.of(batch._replace(**fields), rollout, sampled, kappa)
        batch = scored.batch._replace(advantages=advantages)
        weights = () if correction is None else (correction,)  # what the refreshed credit's advantages carry
        if spec.proximal == "recompute":  # AReaL's decoupled objective: clip against the current (proximal) policy
            self.compiling("the proximal log-probs")
            proximal, capped, proximal_metrics, weighed = self.proximal_inputs(state["actor"], batch)
            batch = batch._replace(**proximal)
            importance = {**importance, **proximal_metrics}
            weights += (capped,)
            # A stale batch's importance weights first: named where a non-finite value arose, then where it spread.
            finite = {"importance weights": weighed.pop("importance weights"), **finite, **weighed}
        importance = {name: float(value) for name, value in importance.items()}  # read back before the next programs
        batch = offload.to_update(batch)
        state["actor_opt"] = offload.fetch(state["actor_opt"])
        actor_hyper = dict(
            learning_rate=spec.actor_lr * knobs["actor_lr_multiplier"],
            clip=knobs["clip"],
            kl_coef=spec.kl_coef * knobs["kl_multiplier"],
            grad_clip=knobs["actor_grad_clip"],
        )
        critic_hyper = dict(
            learning_rate=spec.critic_lr * knobs["critic_lr_multiplier"],
            value_clip=knobs["value_clip"],
            grad_clip=knobs["critic_grad_clip"],
        )
        update_actor = step > self.warmup
        update_metrics, gate_changes = [], []
        rows = batch.response_mask.shape[0]
        # A non-finite reward, value, advantage or return skips the whole update.
        nonfinite = nonfinite_credit(sampled.rewards, **finite)
        size = spec.minibatch_size
        # step - 1: the shuffles of the earlier 0-based numbering, so earlier runs reproduce
        orders = [
            np.random.default_rng([spec.seed, step - 1, epoch]).permutation(rows)
            for epoch in range(0 if nonfinite else int(knobs["actor_epochs"]))
        ]

        computed = []  # (real, computed) tokens of each minibatch read: integers, so their ratio is exact

        def minibatch_of(picked) -> tuple[Minibatch, np.ndarray | None]:
            """(what a step reads, the rows it picks there): the whole batch and the minibatch's rows, selected inside
            the step's program (`update.on_rows`); with the batch on the host, the minibatch placed from there. With
            train.packing, the minibatch's own packed rows ride along (`take_rows` leaves them)."""
            packing = None
            if spec.packing:
                lengths, length = sampled.host_lengths[picked], batch.tokens.shape[1]
                packing = worth_packing(lengths, length, multiple=self.row_multiple, min_saving=spec.packing_min_saving)
                computed.append(
                    (int(lengths.sum()), len(lengths) * length if packing is None else packing.segment_ids.size)
                )
                packing = None if packing is None else on_devices(packing, self.mesh)
            if offload.update_on_host:
                placed = sharding.from_host(take_rows(batch, picked), self.batch_shardings)
                return placed._replace(packing=packing), None
            return batch._replace(packing=packing), picked

        critic_first = spec.critic_first
        interleaved = state["critic"] is not None and not critic_first  # a critic step after each actor step
        critic_metrics = []
        if critic_first:  # the critic's epochs, then its features go: the actor's epochs hold no more than GRPO's
            for order in orders:
                for start in range(0, rows, size):
                    batch_read, picked = minibatch_of(order[start : start + size])
                    critic_metrics.append(self.critic_step(state, batch_read, critic_hyper, picked))
            features = [
                x
                for source in (batch, scored.batch, experience.rollout)
                for x in (source.hidden_states, source.routing)
            ]
            batch, scored = without_features(batch), scored._replace(batch=without_features(scored.batch))
            free_device_arrays(
                *jax.tree.leaves(features)
            )  # every device copy, though the caller's experience still names one
        for epoch, order in enumerate(orders):
            # Epoch 0's actor is the behaviour policy (as is every epoch's during the critic warm-up): its gate is the
            # rollout's.
            if spec.gate_refresh == "epoch" and epoch > 0 and update_actor:
                self.compiling("the gate refresh")
                fresh, change = self.refreshed_credit(
                    scored.batch,
                    signals._replace(kappa=self.refreshed_gate(state["actor"], scored.batch)),
                    scored.kappa,
                    step_rng,
                    knobs["advantage_clip"],
                    weights,
                )
                gate_changes.append(float(change))
                # A non-finite refreshed credit is caught by the steps' own guards (actor_finite, critic_finite).
                batch = batch._replace(**offload.to_update(fresh))
            for start in range(0, rows, size):
                out = {}
                if update_actor or interleaved:
                    batch_read, picked = minibatch_of(order[start : start + size])
                if update_actor:
                    self.compiling("the actor update")
                    state["actor"], state["actor_opt"], out = apply_actor_step(
                        steps, state["actor"], state["actor_opt"], batch_read, actor_hyper, picked
                    )
                if interleaved:
                    out = {**out, **self.critic_step(state, batch_read, critic_hyper, picked)}
                update_metrics.append(out)
        if critic_first:  # one entry per minibatch, actor's then critic's, as the interleaved order gives them
            update_metrics = [{**actor, **critic} for actor, critic in zip(update_metrics, critic_metrics)]
        update_metrics = [{k: float(v) for k, v in out.items()} for out in update_metrics]
        state["actor_opt"] = offload.park(state["actor_opt"])
        for name, quantity in (
            ("actor_finite", "actor loss or gradient norm"),
            ("critic_finite", "critic loss or gradient norm"),
        ):
            unapplied = sum(m.pop(name, 1.0) == 0.0 for m in update_metrics)
            if unapplied:  # those minibatches' updates were skipped inside the jitted step
                nonfinite.append(f"{quantity} ({unapplied} of {len(update_metrics)} minibatches)")
        self.skipped.record(nonfinite)
        metrics = (
            {k: float(np.mean([m[k] for m in update_metrics])) for k in update_metrics[0]} if update_metrics else {}
        )
        if spec.packing:  # real tokens / computed tokens, packed or (too little to save) not
            length = sampled.generation.tokens.shape[1]
            metrics["packing/scoring_efficiency"] = efficiency(sampled.host_lengths, experience.packing, length)
            if computed:
                metrics["packing/update_efficiency"] = sum(r for r, _ in computed) / sum(c for _, c in computed)
        gate_change = float(np.mean(gate_changes)) if gate_changes else None
        return state, Learned(scored, batch, metrics, gate_change, nonfinite, update_actor, importance)

    def critic_step(self, state: dict, batch: Minibatch, hyper: dict, rows=None) -> dict:
        """One critic update on the minibatch of `rows` of `batch` (rows None: `batch` is the minibatch;
        state["critic"] and its optimizer state replaced); its metrics."""
        self.compiling("the critic update")
        state["critic"], state["critic_opt"], out = self.steps.critic_on_rows(
            state["critic"], state["critic_opt"], batch, rows, hyper
        )
        return out

    def control(self, metrics: dict, learned: Learned) -> None:
        """The phase controller reads the step's metrics (only after an applied actor update)."""
        if learned.applied_actor and not learned.nonfinite:
            self.control_state = controller.update(self.control_state, metrics, self.control_config)

    @property
    def phase(self) -> str:
        return controller.PHASES[int(self.control_state["phase"])]
